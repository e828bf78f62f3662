"""Every run's metrics: one line a step in metrics.jsonl, TensorBoard event files (read back here record by
record), curves.png at the end drawn from every step (a resumed run's too), and trackers a user must install
refused with what to install."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from fulmen.algorithm.service.reporting import RunReport, read_metrics
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import TrainStep


def step(number: int, **extra: float) -> TrainStep:
    return TrainStep(
        run_id="run-report-1",
        step=number,
        model_version=number,
        num_transitions=8,
        num_groups=2,
        reward_mean=0.1 * number,
        reward_std=0.2,
        loss=1.0 / number,
        kl=None,
        tokens_per_s=100.0,
        extra={"entropy": 0.5, **extra},
    )


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files under ``logdir`` (TFRecord framing: length, its CRC, data, its CRC)."""
    from tensorboardX.proto import event_pb2

    found: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                found.setdefault(value.tag, []).append((event.step, value.simple_value))
    return found


def test_each_step_goes_to_metrics_jsonl_and_tensorboard(tmp_path: Path) -> None:
    report = RunReport(tmp_path, "run-report-1", "tensorboard")
    report.step(step(1, initial_val_accuracy=0.25, val_accuracy=0.5))
    report.step(step(2, val_accuracy=0.75))
    curves = report.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["extra/val_accuracy"] == 0.75
    assert "train/kl" not in rows[0]  # no reference model: no KL, rather than a 0 that is not one
    logged = scalars(tmp_path / "tensorboard")
    assert logged["train/reward_mean"] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2))]
    assert logged["extra/val_accuracy"] == [(0, 0.25), (1, 0.5), (2, 0.75)]  # from before the first update
    assert curves == tmp_path / "curves.png" and curves.stat().st_size > 10_000


def test_a_resumed_run_draws_every_step_and_a_redone_step_once(tmp_path: Path) -> None:
    first = RunReport(tmp_path, "run-report-1", "none")
    first.step(step(1))
    first.step(step(2))
    first.close()
    again = RunReport(tmp_path, "run-report-1", "none")  # killed after step 2's line, step 2 redone
    again.step(step(2))
    again.step(step(3))
    assert again.close() is not None
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert not (tmp_path / "tensorboard").exists()
    with (tmp_path / "metrics.jsonl").open("a") as torn:
        torn.write('{"step": 4, "train/lo')  # a kill mid-line
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_tracker_that_is_not_installed_says_what_to_install(tmp_path: Path, tracker: str) -> None:
    try:
        __import__(tracker)
    except ImportError:
        with pytest.raises(ConfigurationError, match=f"pip install {tracker}"):
            RunReport(tmp_path, "run-report-1", tracker)
    else:
        pytest.skip(f"{tracker} is installed here")


def test_report_to_is_an_option_of_fulmen_train() -> None:
    from typer.testing import CliRunner

    from fulmen.cli.main import app

    text = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output
    assert "--report-to" in text and "tensorboard" in text
