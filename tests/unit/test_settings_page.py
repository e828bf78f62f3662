"""The settings reference (docs/hooks.py builds it into the site): every variable has a meaning, and the page is
the same from one build to the next (no default drawn at random, such as a run id)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

HOOKS = Path(__file__).resolve().parents[2] / "docs" / "hooks.py"


@pytest.fixture(scope="module")
def page() -> str:
    spec = importlib.util.spec_from_file_location("docs_hooks", HOOKS)
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    first = hooks.settings_page()
    assert hooks.settings_page() == first
    return first


def test_every_setting_says_what_it_means(page: str) -> None:
    rows = [line for line in page.splitlines() if line.startswith("| `FULMEN_")]
    assert len(rows) > 100
    cells = [re.split(r"(?<!\\)\|", row) for row in rows]  # | variable | type | default | meaning |
    assert all(len(c) == 6 for c in cells)
    unexplained = [c[1].strip() for c in cells if not c[4].strip()]
    assert not unexplained, f"settings without a description (Field(description=...)): {unexplained}"


def test_the_run_id_default_is_not_a_drawn_value(page: str) -> None:
    row = next(line for line in page.splitlines() if line.startswith("| `FULMEN_TRAIN_RUN_ID`"))
    assert "a new one each time" in row and "run-" not in re.split(r"(?<!\\)\|", row)[3]


def test_the_optimiser_key_is_listed(page: str) -> None:
    assert "## `FULMEN_OPTIMIZER_API_KEY`" in page
