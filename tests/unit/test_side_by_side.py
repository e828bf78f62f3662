"""The side-by-side agent of docs/from-agent-lightning.md: Fulmen's entry point earns its reward against a scripted
model, and the module imports without Agent Lightning installed (only ``lightning_agent()`` needs it)."""

from __future__ import annotations

import importlib.util

import pytest

from examples.side_by_side import agent


def test_fulmens_entry_point_earns_the_reward_against_a_scripted_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert agent.main() == 0
    assert '"rewards": [1.0, 1.0, 1.0]' in capsys.readouterr().out


def test_the_score_takes_one_number_only() -> None:
    task = {"answer": 42}
    assert agent.score("42", task) == 1.0 and agent.score("The answer is 42.", task) == 1.0
    assert agent.score("41 or 42", task) == 0.0 and agent.score("no idea", task) == 0.0


@pytest.mark.skipif(importlib.util.find_spec("agentlightning") is not None, reason="agentlightning is installed")
def test_agent_lightnings_entry_point_needs_only_its_own_package() -> None:
    with pytest.raises(ImportError):
        agent.lightning_agent()
