"""Every prompt-search option is declared once (``PromptSearchOptions``): listed in ``fulmen optimize-prompt
--help`` under its field's name (and its older short name), and handed to ``fulmen.optimize_prompt`` as the field."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from fulmen.cli.main import app
from fulmen.cli.optimize import SEARCH_OPTIONS
from fulmen.prompt_optimization import PromptSearchOptions

REQUIRED = ["--agent", "a:b", "--dataset", "d.jsonl", "--val", "v.jsonl", "--test", "t.jsonl"]
REQUIRED += ["--optimizer-url", "http://127.0.0.1:9/v1", "--max-rollouts", "50", "--json"]


@pytest.fixture
def called(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def fake(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs, args=args)
        return SimpleNamespace(summary=lambda: {"best_bundle": "pb-1"}, run_dir="/tmp/run", best_slots={})

    monkeypatch.setattr("fulmen.prompt_optimization.optimize_prompt", fake)
    return seen


def test_every_field_is_an_option_in_help() -> None:
    result = CliRunner().invoke(app, ["optimize-prompt", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for name in PromptSearchOptions.model_fields:
        assert "--" + name.replace("_", "-") in result.output, name
    for alias in SEARCH_OPTIONS.aliases.values():
        assert alias in result.output
    assert "FULMEN_SEARCH_" not in result.output  # no variable sets them: none is claimed


def test_options_reach_optimize_prompt_as_fields(called: dict[str, Any]) -> None:
    extra = ["--slot", "fp-1", "--slots", "fp-2", "--search", "beam", "--promote", "--rollout-timeout", "12"]
    result = CliRunner().invoke(app, ["optimize-prompt", *REQUIRED, *extra, "--only-agent", "write"])
    assert result.exit_code == 0, result.output
    assert called["slots"] == ["fp-1", "fp-2"]
    assert (called["search"], called["promote"], called["rollout_timeout_s"]) == ("beam", True, 12.0)
    assert called["agents"] == ["write"]
    assert "roles" not in called and "seed" not in called  # not given: the field's default
    assert PromptSearchOptions(**{k: called[k] for k in PromptSearchOptions.model_fields if k in called}).slots == (
        "fp-1",
        "fp-2",
    )


def test_no_options_given_passes_none(called: dict[str, Any]) -> None:
    result = CliRunner().invoke(app, ["optimize-prompt", *REQUIRED])
    assert result.exit_code == 0, result.output
    assert not set(called) & set(PromptSearchOptions.model_fields)
