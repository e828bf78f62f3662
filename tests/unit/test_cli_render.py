"""How `fulmen sql` prints: CSV with Unix line ends, tables that never cut a value."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from fulmen.cli.render import render
from fulmen.infra.store import QueryResult

pytestmark = pytest.mark.security


def test_csv_lines_end_with_a_newline_only() -> None:
    out = io.StringIO()
    render(QueryResult(["a", "b"], [[1, "x"], [2, None]]), "csv", Console(file=out))
    assert out.getvalue() == "a,b\n1,x\n2,\n"


def test_a_long_value_is_shown_whole_in_a_narrow_table() -> None:
    value = "span-" + "0123456789" * 12
    out = io.StringIO()
    render(QueryResult(["id", "name"], [[1, value]]), "table", Console(file=out, width=60))
    cells = "".join(line.strip(" │┃|") for line in out.getvalue().splitlines())
    assert value in cells.replace(" ", "").replace("│", "")
    assert "…" not in out.getvalue()
