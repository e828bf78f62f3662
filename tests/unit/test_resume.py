"""A named run resumes where it stopped: the torch trainer's optimizer state, step count and RNG come back from the
latest checkpoint (the next step equals the uninterrupted run's), the dataset continues past the groups trained,
a finished run is refused with how to go on, and ``fulmen runs`` reads the run directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fulmen.algorithm.service.dispatcher import DatasetTask, Dispatcher
from fulmen.algorithm.service.run import _resumed
from fulmen.algorithm.settings import TrainSection
from fulmen.algorithm.trainer.base import TRAINING_STATE
from fulmen.schemas.errors import ConfigurationError
from tests.unit.test_torch_trainer import make_samples, make_trainer, model_dir, trainable

__all__ = ["model_dir"]


def test_a_resumed_trainer_takes_the_same_next_step(model_dir: Path, tmp_path: Path) -> None:
    straight = make_trainer(model_dir)
    straight.step(make_samples(1))
    saved = straight.save(tmp_path / "v1")
    straight.step(make_samples(2))
    assert (saved / TRAINING_STATE).is_file()

    resumed = make_trainer(saved)  # a new process: the checkpoint's weights...
    assert resumed.load_training_state(saved)  # ...and its optimizer moments, step count, RNG
    assert resumed.steps == 1
    resumed.step(make_samples(2))
    for name, weight in trainable(straight).items():
        torch.testing.assert_close(trainable(resumed)[name], weight, rtol=0, atol=0, msg=name)

    fresh = make_trainer(saved)  # without the state: Adam starts over, and the step differs
    fresh.step(make_samples(2))
    assert any(not torch.equal(trainable(fresh)[n], w) for n, w in trainable(straight).items())


def test_a_lora_checkpoint_has_no_optimizer_state_to_resume(model_dir: Path, tmp_path: Path) -> None:
    from fulmen.algorithm.trainer.torch_backend import LoraSettings

    trainer = make_trainer(model_dir, lora=LoraSettings(r=4))
    trainer.step(make_samples(1))
    saved = trainer.save(tmp_path / "v1")
    assert not (saved / TRAINING_STATE).exists() and not trainer.load_training_state(saved)


def test_the_dataset_continues_past_the_groups_trained() -> None:
    tasks = [DatasetTask(f"t{i}", {"q": i}) for i in range(5)]
    straight = Dispatcher(None, tasks, group_size=2, max_in_flight=1, shuffle=True, seed=3)  # type: ignore[arg-type]
    order = [straight._take().task_id for _ in range(12)]  # two and a half passes
    resumed = Dispatcher(None, tasks, group_size=2, max_in_flight=1, shuffle=True, seed=3)  # type: ignore[arg-type]
    resumed.skip(7)
    assert [resumed._take().task_id for _ in range(5)] == order[7:]


def test_a_finished_run_is_refused_with_how_to_go_on(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "v3").mkdir(parents=True)
    (tmp_path / "checkpoints" / "v3" / "config.json").write_text("{}")
    # saved but not recorded (stopped before its publish): it goes on, to publish v3
    assert _resumed(TrainSection(run_id="named", steps=3), tmp_path) == (3, tmp_path / "checkpoints" / "v3")
    (tmp_path / "metrics.jsonl").write_text('{"step": 3}\n')
    with pytest.raises(ConfigurationError, match=r"run named is finished.*pass --steps N above 3"):
        _resumed(TrainSection(run_id="named", steps=3), tmp_path)
    assert _resumed(TrainSection(run_id="named", steps=5), tmp_path) == (3, tmp_path / "checkpoints" / "v3")
    assert _resumed(TrainSection(run_id="named", steps=3), tmp_path / "new") is None


def test_runs_list_and_show_read_the_run_directories(tmp_path: Path) -> None:
    from fulmen.cli.main import app

    run = tmp_path / "runs" / "mine"
    (run / "checkpoints" / "v2").mkdir(parents=True)
    (run / "checkpoints" / "v2" / "config.json").write_text("{}")
    (run / "train_settings.json").write_text(json.dumps({"steps": 4, "model_path": "tiny"}))
    rows = [{"step": 1, "train/reward_mean": 0.25, "train/loss": 0.5}, {"step": 2, "train/reward_mean": 0.5}]
    rows[1]["extra/val_accuracy"] = 0.75
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {"FULMEN_HOME": str(tmp_path), "COLUMNS": "200"}
    listed = CliRunner().invoke(app, ["runs", "list"], env=env)
    assert listed.exit_code == 0, listed.output
    assert "mine" in listed.output and "stopped (resumable)" in listed.output and "2/4" in listed.output
    shown = CliRunner().invoke(app, ["runs", "show", "mine"], env=env)
    assert shown.exit_code == 0, shown.output
    assert "0.750" in shown.output and "--run mine" in shown.output and "fulmen export mine" in shown.output
    missing = CliRunner().invoke(app, ["runs", "show", "nope"], env=env)
    assert missing.exit_code == 1 and "no run 'nope'" in missing.output


def test_run_is_an_option_of_fulmen_train() -> None:
    from fulmen.cli.main import app

    text = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output
    assert "--run-id,--run" in text.replace(" ", "")
