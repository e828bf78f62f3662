"""`fulmen train --local`: the options reach :func:`fulmen.train` and its report is printed; bad options are refused
before anything starts. The real run behind it (the stack, the runners, two steps) is
tests/integration/test_train_local.py's, through the same function."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import fulmen.training
from fulmen.algorithm.local import TrainReport
from fulmen.cli.main import app
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import TrainStep


@pytest.fixture
def dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("FULMEN_TRAIN_AGENT", "FULMEN_TRAIN_NPROC", "FULMEN_TRAIN_MODEL_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FULMEN_HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")
    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "Say hi."}\n')
    return path


def test_the_options_reach_fulmen_train_and_the_report_is_printed(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def fake_train(agent: str, data: Path, model: str, **options: Any) -> TrainReport:
        seen.update(agent=agent, dataset=data, model=model, **options)
        options["on_step"](
            TrainStep(
                run_id="train-x",
                step=1,
                reward_mean=0.5,
                reward_std=0.0,
                loss=0.25,
                model_version=1,
                num_transitions=2,
                num_groups=1,
                extra={"val_accuracy": 0.75},
            )
        )
        return TrainReport(
            "train-x",
            tmp_path / "run",
            1,
            tmp_path / "run" / "checkpoints" / "v1",
            [(1, 0.5)],
            [(0, 0.25), (1, 0.75)],
            [(1, 0.25)],
            12.0,
        )

    monkeypatch.setattr(fulmen.training, "train", fake_train)
    done = CliRunner().invoke(
        app,
        [
            "train",
            "--local",
            "--dataset",
            str(dataset),
            "--agent",
            "tests.agents.chat:ask",
            "--model",
            "tiny",
            "--runners",
            "2",
            "--concurrency",
            "4",
            "--steps",
            "1",
        ],
    )
    assert done.exit_code == 0, done.output
    assert seen["agent"] == "tests.agents.chat:ask" and seen["dataset"] == dataset and seen["model"] == "tiny"
    assert seen["runners"] == 2 and seen["concurrency"] == 4 and seen["settings"].train.steps == 1
    assert "step 1: reward 0.500, loss 0.2500, held-out accuracy 0.750" in done.output
    assert "run train-x: 1 step(s) in 12s" in done.output
    assert f"final model: {tmp_path / 'run' / 'checkpoints' / 'v1'}" in done.output.replace("\n", "")


def test_local_needs_an_agent_and_one_process(dataset: Path) -> None:
    refused = CliRunner().invoke(app, ["train", "--local", "--dataset", str(dataset)])
    assert refused.exit_code == 1 and "--local runs the agent: pass --agent" in refused.output
    refused = CliRunner().invoke(app, ["train", "--local", "--dataset", str(dataset), "--agent", "a:b", "--nproc", "2"])
    assert refused.exit_code == 1 and "--local trains in one process" in refused.output


@pytest.mark.continuous
def test_replay_and_promotion_options_reach_the_settings_and_nothing_to_train_on_is_refused(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def fake_train(agent: str, data: Path | None, model: str, **options: Any) -> TrainReport:
        seen.update(dataset=data, train=options["settings"].train)
        return TrainReport("train-x", tmp_path / "run", 0, None, [], [], [], 1.0)

    monkeypatch.setattr(fulmen.training, "train", fake_train)
    done = CliRunner().invoke(
        app,
        [
            "train",
            "--local",
            "--agent",
            "a:b",
            "--replay",
            "SELECT RolloutId FROM r",
            "--source-store",
            str(tmp_path),
            "--replay-fraction",
            "0.5",
            "--max-staleness",
            "3",
            "--promote-if-better",
            "--promote-margin",
            "0.05",
        ],
    )
    assert done.exit_code == 0, done.output
    options = seen["train"]
    assert seen["dataset"] is None and options.replay_sql == "SELECT RolloutId FROM r"
    assert (options.source_store, options.replay_fraction, options.max_staleness) == (str(tmp_path), 0.5, 3)
    assert options.promote_if_better and options.promote_margin == 0.05 and options.correction == "tis"
    refused = CliRunner().invoke(app, ["train", "--local", "--agent", "a:b"])
    assert refused.exit_code == 1 and "pass --dataset FILE or --tasks-sql SQL" in refused.output
    monkeypatch.undo()  # the real fulmen.train refuses too, before starting anything
    with pytest.raises(ConfigurationError, match="nothing to train on"):
        fulmen.training.train("a:b", None)
