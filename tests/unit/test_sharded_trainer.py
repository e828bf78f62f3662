"""FSDP2 over gloo ranks on the tiny model: the same steps with 1 and with 2 ranks (torchrun) update the weights
alike and report the same loss, both as one process (TorchTrainer) does; shards balance tokens; metrics combine.

Tolerance: weights within 1e-6 (absolute; float32 sums in another order: measured up to 1.3e-7), losses and
gradient norms within a relative 1e-5."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fulmen.algorithm.tiny_model import build_tiny_model
from fulmen.algorithm.trainer.base import StepMetrics
from fulmen.algorithm.trainer.distributed import (
    combine_metrics,
    model_here,
    relaunch_command,
    several_machines,
    shard_by_tokens,
)
from fulmen.algorithm.trainer.torch_backend import TorchTrainer, TorchTrainerConfig
from fulmen.schemas.errors import ConfigurationError
from tests.unit import sharded_steps
from tests.unit.test_torch_trainer import TINY, make_samples

pytestmark = pytest.mark.scale

WEIGHT_ATOL = 1e-6
METRIC_REL = 1e-5
HARNESS = Path(sharded_steps.__file__)


@pytest.fixture(scope="module")
def runs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The cases of ``sharded_steps`` run under torchrun with 1 and with 2 ranks: rank count -> output dir."""
    out = {}
    for ranks in (1, 2):
        out[ranks] = tmp_path_factory.mktemp(f"ranks{ranks}")
        command = relaunch_command(ranks, [str(HARNESS), str(model_dir), str(out[ranks])])
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", TINY)


def one_process(model_dir: Path, case: str, out: Path) -> list[dict[str, float]]:
    """The case's steps with TorchTrainer in this process; its checkpoint goes to ``out``."""
    trainer = TorchTrainer(sharded_steps.config_of(model_dir, case))
    metrics = [trainer.step(sharded_steps.samples_of(*step)).as_dict() for step in sharded_steps.STEPS[case]]
    trainer.save(out)
    metrics.append(trainer.sft_step(make_samples(9)).as_dict())
    return metrics


def assert_same_metrics(got: list[dict[str, float]], want: list[dict[str, float]]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=METRIC_REL, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=METRIC_REL)
        for name in ("kl", "clip_fraction", "approx_kl", "ratio_mean"):
            assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-7), name
        assert (a["tokens"], a["input_tokens"], a["skipped_updates"]) == (b["tokens"], b["input_tokens"], 0)


def assert_same_weights(got: Path, want: Path) -> None:
    a, b = load_file(got / "model.safetensors"), load_file(want / "model.safetensors")
    assert sorted(a) == sorted(b)  # one file each, tied head not written twice
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=WEIGHT_ATOL, msg=name)
    assert json.loads((got / "config.json").read_text()) == json.loads((want / "config.json").read_text())
    assert (got / "tokenizer.json").is_file()


@pytest.mark.parametrize("case", list(sharded_steps.CASES))
def test_one_and_two_ranks_give_the_weights_and_loss_of_one_process(
    runs: dict[int, Path], model_dir: Path, tmp_path: Path, case: str
) -> None:
    reference = one_process(model_dir, case, tmp_path / case)
    before = load_file(model_dir / "model.safetensors")
    for ranks in (1, 2):
        assert_same_metrics(json.loads((runs[ranks] / "metrics.json").read_text())[case], reference)
        assert_same_weights(runs[ranks] / case, tmp_path / case)
    after = load_file(tmp_path / case / "model.safetensors")
    moved = {name for name in before if not torch.equal(after[name], before[name])}
    if case == "lora":  # merged: the adapted projections moved, nothing else
        assert moved and all(name.endswith("proj.weight") for name in moved), sorted(set(before) - moved)
    else:
        assert moved == set(before)


def test_shards_balance_tokens_and_keep_every_row_once_in_order() -> None:
    lengths = [50, 3, 3, 3, 3, 40, 2, 9]
    shards = shard_by_tokens(lengths, 2)
    assert sorted(i for shard in shards for i in shard) == list(range(len(lengths)))
    assert all(shard == sorted(shard) for shard in shards)
    assert sorted(sum(lengths[i] for i in shard) for shard in shards) == [56, 57]
    assert shard_by_tokens([5], 3) == [[0], [], []]
    assert shard_by_tokens([], 2) == [[], []]
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        shard_by_tokens([1], 0)


def test_metrics_of_the_ranks_combine_into_the_whole_batch() -> None:
    a = StepMetrics(
        step=3,
        loss=0.25,
        grad_norm=2.0,
        tokens=30,
        input_tokens=50,
        tokens_per_s=0.0,
        train_s=2.0,
        epochs=2,
        clip_fraction=0.1,
        kl=0.02,
        approx_kl=0.001,
        ratio_mean=1.1,
    )
    b = StepMetrics(
        step=3,
        loss=-0.05,
        grad_norm=2.0,
        tokens=10,
        input_tokens=30,
        tokens_per_s=0.0,
        train_s=4.0,
        epochs=2,
        clip_fraction=0.5,
        kl=0.06,
        approx_kl=0.005,
        ratio_mean=0.9,
    )
    empty = StepMetrics(
        step=3,
        loss=0.0,
        grad_norm=2.0,
        tokens=0,
        input_tokens=0,
        tokens_per_s=0.0,
        train_s=1.0,
        epochs=2,
        ratio_mean=1.0,
    )
    whole = combine_metrics([a, b, empty])
    assert whole.loss == pytest.approx(0.2) and whole.grad_norm == 2.0 and whole.step == 3
    assert (whole.tokens, whole.input_tokens, whole.train_s) == (40, 80, 4.0)
    assert whole.tokens_per_s == pytest.approx(80 * 2 / 4.0)
    assert whole.clip_fraction == pytest.approx(0.2) and whole.kl == pytest.approx(0.03)
    assert whole.ratio_mean == pytest.approx(1.05) and whole.approx_kl == pytest.approx(0.002)


def test_relaunch_is_standalone_unless_torchrun_variables_name_several_machines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("PET_NNODES", "PET_RDZV_ENDPOINT", "PET_MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    assert relaunch_command(4, ["-m", "x"]) == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=4",
        "--standalone",
        "-m",
        "x",
    ]
    monkeypatch.setenv("PET_NNODES", "2")
    assert "--standalone" not in relaunch_command(4, ["-m", "x"])


def test_a_rank_on_another_machine_fetches_the_model_only_when_its_path_is_missing_there(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert several_machines()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert not several_machines()

    here = TorchTrainerConfig(model_path=str(tmp_path))
    assert model_here(here, "s3://fulmen/runs/r/v3") is here  # on this machine's disk: nothing fetched
    named = TorchTrainerConfig(model_path="some-org/some-model")
    assert model_here(named, None) is named  # a name, not a path: the loader resolves it
    missing = TorchTrainerConfig(model_path=str(tmp_path / "runs" / "r" / "checkpoints" / "v3"))
    with pytest.raises(ConfigurationError, match="not on this machine .* FULMEN_TRAIN_CHECKPOINT_URI"):
        model_here(missing, None)
    fetched = tmp_path / "home" / "model-cache" / "v3-abc"
    calls = []

    def download_dir(uri: str, cache: Path) -> Path:
        calls.append((uri, cache))
        return fetched

    monkeypatch.setenv("FULMEN_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("fulmen.infra.objectstore.download_dir", download_dir)
    assert model_here(missing, "s3://fulmen/runs/r/v3").model_path == str(fetched)
    assert calls == [("s3://fulmen/runs/r/v3", tmp_path / "home" / "model-cache")]


def test_an_unknown_trainer_backend_is_a_configuration_error_listing_the_valid_ones() -> None:
    from fulmen.algorithm.service.run import build_backend
    from fulmen.algorithm.settings import TrainSection
    from fulmen.schemas.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=r"unknown trainer backend 'deepspeed'; valid: torch, verl"):
        build_backend(TrainSection(backend="deepspeed"), "unused")


def test_the_verl_backend_with_several_ranks_is_refused_at_start() -> None:
    from pydantic import ValidationError

    from fulmen.algorithm.settings import TrainSection

    with pytest.raises(ValidationError, match="verl trains in one process"):
        TrainSection(backend="verl", nproc=2)
