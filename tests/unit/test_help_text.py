"""Help reads as paragraphs: no command's description breaks where its docstring's lines did, flags carry no type
tag, and the dashboard's help names every page it serves."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from fulmen.cli.help_text import flowed
from fulmen.cli.main import app
from fulmen.dashboard.app import PAGES


def _help(*args: str, columns: int = 200) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": str(columns), "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.output


def test_flowed_joins_a_paragraphs_lines_and_keeps_lists() -> None:
    text = "One sentence that\n    goes on.\n\n    Items:\n    - first\n    - second\n      indented"
    assert flowed(text) == "One sentence that goes on.\n\nItems:\n- first\n- second\n  indented"


def test_command_list_rows_are_whole_sentences_at_any_width() -> None:
    for columns in (200, 100):
        text = _help(columns=columns)
        rows = [line for line in text.splitlines() if line.startswith("│")]
        # a description broken at its docstring's line end left a row ending mid-sentence on a word like "the"
        cut = [row for row in rows if re.search(r"\b(the|a|of|and|to)\s*│$", row.rstrip())]
        width_cut = [row for row in cut if len(row.rstrip()) < columns - 30]
        assert not width_cut, width_cut


def test_flags_show_no_type_tag() -> None:
    assert "<bool>" not in _help()
    assert "<bool>" not in _help("train")


def test_dashboard_help_names_every_page() -> None:
    text = " ".join(_help("dashboard").split())
    for path in PAGES:
        if path not in ("/", "/rollout"):
            assert path in text, path
