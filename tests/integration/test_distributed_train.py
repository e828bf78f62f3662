"""``fulmen train`` over two gloo ranks (FSDP2) against a real broker: a rank that dies mid-step ends the run with
a clear error and no model version for that step; ``fulmen train --nproc 2`` (torchrun, re-launched by itself)
then resumes from the last checkpoint and publishes the next version, once."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from fulmen.infra.settings import FulmenSettings
from fulmen.schemas import ModelVersion, TopicKey, TrainStep
from tests.integration.test_train_loop import FULMEN, read_topic, simulated_runners

pytestmark = [pytest.mark.integration, pytest.mark.scale]

CRASHING = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc-per-node=2",
    str(Path(__file__).with_name("crashing_rank.py")),
]


async def run(command: list[str], env: dict[str, str]) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *command, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(process.communicate(), 300)
    return process.returncode or 0, out.decode()


async def test_a_dead_rank_ends_the_run_unpublished_and_a_restart_on_two_ranks_resumes(
    settings: FulmenSettings, tmp_path: Path
) -> None:
    dataset = tmp_path / "train.jsonl"
    dataset.write_text('{"question": "1 + 1"}\n{"question": "2 + 2"}\n')
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {
        "FULMEN_KAFKA_BOOTSTRAP": settings.bootstrap,
        "FULMEN_KAFKA_TOPIC_PREFIX": settings.kafka.topic_prefix,
        "FULMEN_HOME": str(tmp_path),
        "FULMEN_TRAIN_RUN_DIR": str(run_dir),
        "FULMEN_TRAIN_GROUP_SIZE": "2",
        "FULMEN_TRAIN_GROUPS_PER_STEP": "1",
        "FULMEN_TRAIN_DEVICE": "cpu",
        "FULMEN_TRAIN_RUN_ID": "dist-run",
        "FULMEN_TRAIN_MICRO_BATCH_SIZE": "2",
        "FULMEN_TRAIN_DIST_TIMEOUT_S": "60",
    }
    args = ["train", "--dataset", str(dataset), "--model", "tiny"]
    stop = asyncio.Event()
    runners = asyncio.create_task(simulated_runners(settings, stop))
    try:
        crashed = await run([*CRASHING, *args, "--steps", "3"], env)
        after_crash = await read_topic(settings, TopicKey.MODELS, ModelVersion)
        saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        resumed = await run([*FULMEN, *args, "--steps", "2", "--nproc", "2"], env)
    finally:
        stop.set()
        await asyncio.wait_for(runners, 60)
    code, output = crashed
    assert code != 0, output
    assert "exitcode  : 3" in output and "rank      : 1" in output, output  # torchrun names the rank that died
    assert "error: step 2 failed" in output and "no model version is published for it" in output, output  # rank 0
    assert [v.version for v in after_crash] == [1]  # step 2 never completed on every rank: not published
    assert saved == ["v1"]
    code, output = resumed
    assert code == 0, output
    assert "training on 2 ranks" in output and "dist-run: 1 step(s) trained" in output, output
    versions = await read_topic(settings, TopicKey.MODELS, ModelVersion)
    assert [(v.version, v.uri) for v in versions] == [(n, str(run_dir / "checkpoints" / f"v{n}")) for n in (1, 2)]
    steps = await read_topic(settings, TopicKey.METRICS, TrainStep)
    assert [(s.run_id, s.step) for s in steps] == [("dist-run", 1), ("dist-run", 2)]
    assert all(s.loss == s.loss and s.tokens_per_s > 0 for s in steps)


async def test_ctrl_c_on_two_ranks_finishes_the_step_it_is_in_and_every_rank_exits(
    settings: FulmenSettings, tmp_path: Path
) -> None:
    """SIGINT to torchrun (it forwards it to both ranks, as Ctrl-C reaches the whole process group): rank 0 stops
    after the step in progress, which is saved and published; rank 1 does not die mid-step but is told to stop."""
    dataset = tmp_path / "train.jsonl"
    dataset.write_text('{"question": "1 + 1"}\n{"question": "2 + 2"}\n')
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {
        "FULMEN_KAFKA_BOOTSTRAP": settings.bootstrap,
        "FULMEN_KAFKA_TOPIC_PREFIX": settings.kafka.topic_prefix,
        "FULMEN_HOME": str(tmp_path),
        "FULMEN_TRAIN_RUN_DIR": str(run_dir),
        "FULMEN_TRAIN_GROUP_SIZE": "2",
        "FULMEN_TRAIN_GROUPS_PER_STEP": "1",
        "FULMEN_TRAIN_DEVICE": "cpu",
        "FULMEN_TRAIN_RUN_ID": "sigint-run",
    }
    stop = asyncio.Event()
    runners = asyncio.create_task(simulated_runners(settings, stop))
    process = await asyncio.create_subprocess_exec(
        *FULMEN,
        "train",
        "--dataset",
        str(dataset),
        "--model",
        "tiny",
        "--steps",
        "50",
        "--nproc",
        "2",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        while not await read_topic(settings, TopicKey.MODELS, ModelVersion):
            await asyncio.sleep(0.5)
        process.send_signal(signal.SIGINT)
        out, _ = await asyncio.wait_for(process.communicate(), 120)
    finally:
        if process.returncode is None:
            process.kill()
        stop.set()
        await asyncio.wait_for(runners, 60)
    output = out.decode()
    versions = await read_topic(settings, TopicKey.MODELS, ModelVersion)
    assert 1 <= len(versions) < 50 and [v.version for v in versions] == list(range(1, len(versions) + 1)), output
    assert all((Path(v.uri) / "config.json").is_file() for v in versions)
    assert f"sigint-run: {len(versions)} step(s) trained" in output, output  # rank 0 ended the run itself
    assert "rank 1: stopping, as rank 0 asked" in output, output  # rank 1 did not die mid-step: it was told to stop
    assert "Root Cause" not in output and "[rank1]: Traceback" not in output, output  # no rank failed (torchrun's
    # agent itself still ends with its SignalException traceback, as torchrun does on SIGINT)
