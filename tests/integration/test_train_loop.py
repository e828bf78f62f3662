"""The training loop against a real broker: dispatched requests are answered by simulated runners that publish
TransitionBatches (random token ids, a reward); two steps on the tiny model publish versions 1 and 2 (loadable
checkpoints) and two TrainStep events, with a validation pass reported in the last one."""

from __future__ import annotations

import asyncio
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka import TopicPartition

from fulmen.algorithm.service.dispatcher import DatasetTask
from fulmen.algorithm.service.run import run_trainer
from fulmen.algorithm.settings import TrainSettings
from fulmen.infra.kafka.clients import consumer, start_or_raise
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas import (
    ModelVersion,
    RolloutMode,
    RolloutRequest,
    RolloutStatus,
    TopicKey,
    TrainStep,
    Transition,
    TransitionBatch,
    decode,
    topic,
    topic_name,
)
from fulmen.schemas.errors import ConfigurationError
from fulmen.testing.publishing import event_publisher

pytestmark = pytest.mark.integration

FULMEN = [sys.executable, "-m", "fulmen.cli.main"]
VOCAB = 250  # the tiny model has 261 tokens (rounded up to 320 embeddings)


def answer(request: RolloutRequest, rng: random.Random) -> TransitionBatch:
    """What runners + the transitions consumer would publish for ``request``: 1-2 calls, reward 0 or 1
    (always 1 in validation, so its accuracy is known)."""
    reward = 1.0 if request.mode is RolloutMode.VAL else float(rng.random() < 0.5)
    calls = []
    for index in range(rng.randint(1, 2)):
        response = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))]
        calls.append(
            Transition(
                rollout_id=request.rollout_id,
                attempt=request.attempt,
                index=index,
                trace_id=f"{rng.getrandbits(128):032x}",
                span_id=f"{rng.getrandbits(64):016x}",
                model_version=request.model_version,
                prompt_token_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(2, 8))],
                response_token_ids=response,
                response_logprobs=[-rng.random() * 3 for _ in response],
                reward=reward,
            )
        )
    return TransitionBatch(
        rollout_id=request.rollout_id,
        attempt=request.attempt,
        task_id=request.task_id,
        group_id=request.group_id,
        mode=request.mode,
        status=RolloutStatus.SUCCEEDED,
        episode_reward=reward,
        model_version=request.model_version,
        transitions=calls,
    )


async def simulated_runners(
    settings: FulmenSettings,
    stop: asyncio.Event,
    hold: Callable[[], bool] = lambda: False,
    respond: Callable[[RolloutRequest, random.Random], TransitionBatch] = answer,
) -> int:
    """Consume the tasks topic (own group) and answer each request on the transitions topic (``respond``: what
    runners would publish for it); how many. While ``hold()`` is true, requests fetched are held unanswered (checked
    after each fetch, so a request dispatched once ``hold()`` became true is never answered before it is false
    again)."""
    tasks = consumer(settings, "test.runners", topic_name(TopicKey.TASKS, settings.kafka.topic_prefix))
    await start_or_raise(tasks, settings)
    rng, answered = random.Random(7), 0
    try:
        async with event_publisher(settings) as publisher:
            while not stop.is_set():
                for records in (await tasks.getmany(timeout_ms=200)).values():
                    while hold() and not stop.is_set():
                        await asyncio.sleep(0.05)
                    requests = [decode(RolloutRequest, r.value) for r in records]
                    await publisher.publish_many(TopicKey.TRANSITIONS, [respond(r, rng) for r in requests])
                    answered += len(requests)
                await tasks.commit()
    finally:
        await tasks.stop()
    return answered


async def read_topic(settings: FulmenSettings, key: TopicKey, model: type) -> list:
    reader = consumer(settings, None)
    await start_or_raise(reader, settings)
    name = topic_name(key, settings.kafka.topic_prefix)
    partitions = [TopicPartition(name, p) for p in range(topic(key).partitions)]
    events = []
    try:
        reader.assign(partitions)
        await reader.seek_to_beginning(*partitions)
        ends = await reader.end_offsets(partitions)
        while [tp for tp, end in ends.items() if await reader.position(tp) < end]:
            for records in (await reader.getmany(timeout_ms=500)).values():
                events.extend(decode(model, r.value) for r in records)
    finally:
        await reader.stop()
    return events


def train_settings(settings: FulmenSettings, model: Path, run_dir: Path) -> TrainSettings:
    return TrainSettings(
        home=settings.home,
        kafka=settings.kafka.model_dump(),
        clickhouse=settings.clickhouse.model_dump(),
        train={
            "model_path": str(model),
            "run_dir": run_dir,
            "run_id": "test-run",
            "steps": 2,
            "group_size": 3,
            "groups_per_step": 2,
            "lr": 1e-4,
            "device": "cpu",
            "dtype": "float32",
            "group_timeout_s": 120,
            "consumer_group": "test.trainer",
            "val_group_size": 2,
        },
    )


async def test_two_steps_publish_two_loadable_versions_and_two_train_steps(
    settings: FulmenSettings, tiny_model: Path, tmp_path: Path
) -> None:
    options = train_settings(settings, tiny_model, tmp_path / "run")
    tasks = [DatasetTask(f"task-{i}", {"question": f"{i} + {i}"}) for i in range(3)]
    val = [DatasetTask(f"val-{i}", {"question": f"{i} * {i}"}) for i in range(2)]
    stop = asyncio.Event()
    runners = asyncio.create_task(simulated_runners(settings, stop))
    try:
        returned = await asyncio.wait_for(run_trainer(options, tasks, val), 300)
    finally:
        stop.set()
        answered = await asyncio.wait_for(runners, 60)

    versions = await read_topic(settings, TopicKey.MODELS, ModelVersion)
    steps = await read_topic(settings, TopicKey.METRICS, TrainStep)
    assert [v.version for v in versions] == [1, 2]
    assert [Path(v.uri) for v in versions] == [tmp_path / "run" / "checkpoints" / f"v{n}" for n in (1, 2)]
    assert {(v.model_name, v.format, v.run_id) for v in versions} == {("fulmen", "hf", "test-run")}
    from transformers import AutoModelForCausalLM

    for version in versions:
        model = await asyncio.to_thread(AutoModelForCausalLM.from_pretrained, version.uri)
        assert model.config.vocab_size >= VOCAB
    assert steps == returned
    assert [(s.step, s.model_version, s.num_groups) for s in steps] == [(1, 1, 2), (2, 2, 2)]
    for step in steps:
        assert step.num_transitions >= 2 * 3  # each rollout made at least one call
        assert step.train_s > 0 and step.tokens_per_s > 0 and step.dropped_stale == 0
    assert steps[0].extra["initial_val_accuracy"] == 1.0
    assert steps[1].extra["val_accuracy"] == 1.0 and steps[1].extra["val_rollouts"] == 4
    assert answered >= 2 * 2 * 3 + 2 * 2 * 2  # two steps of train groups, two validation passes
    assert await committed(settings, "test.trainer", TopicKey.TRANSITIONS) > 0  # the collector committed


async def test_a_run_stops_early_once_the_held_out_accuracy_reaches_its_target(
    settings: FulmenSettings, tiny_model: Path, tmp_path: Path
) -> None:
    options = train_settings(settings, tiny_model, tmp_path / "run")
    options = options.model_copy(
        update={"train": options.train.model_copy(update={"steps": 4, "val_every": 1, "stop_at_val_accuracy": 1.0})}
    )
    tasks = [DatasetTask(f"task-{i}", {"question": f"{i} + {i}"}) for i in range(3)]
    stop = asyncio.Event()
    runners = asyncio.create_task(simulated_runners(settings, stop))
    try:
        returned = await asyncio.wait_for(run_trainer(options, tasks, [DatasetTask("val-0", {"question": "0"})]), 300)
    finally:
        stop.set()
        await asyncio.wait_for(runners, 60)
    assert [s.step for s in returned] == [1]  # its validation scored 1.0 (the runners reward validation with 1)
    assert returned[0].extra["val_accuracy"] == 1.0
    with pytest.raises(ConfigurationError, match="--val FILE"):
        await run_trainer(options, tasks, None)


async def committed(settings: FulmenSettings, group: str, key: TopicKey) -> int:
    """The sum of ``group``'s committed offsets over the partitions of topic ``key``."""
    reader = consumer(settings, group)
    await start_or_raise(reader, settings)
    name = topic_name(key, settings.kafka.topic_prefix)
    try:
        offsets = [await reader.committed(TopicPartition(name, p)) for p in range(topic(key).partitions)]
    finally:
        await reader.stop()
    return sum(o or 0 for o in offsets)


async def fulmen_train(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *FULMEN, "train", *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 300)
    return process.returncode or 0, out.decode(), err.decode()[-3000:]


def first_step_done(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.is_file() and bool(metrics.read_text().strip())


async def killed_after_first_step(env: dict[str, str], run_dir: Path, *args: str) -> None:
    """``fulmen train`` killed with SIGKILL once its first step is done (published and committed: in metrics.jsonl),
    so in its second step (the runners hold the rollouts dispatched after step 1 until the kill: step 3 cannot
    finish first, however slowly this test is scheduled)."""
    process = await asyncio.create_subprocess_exec(
        *FULMEN, "train", *args, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    deadline = asyncio.get_running_loop().time() + 300
    while not first_step_done(run_dir):
        assert process.returncode is None and asyncio.get_running_loop().time() < deadline, "no step 1"
        await asyncio.sleep(0.2)
    process.kill()
    await process.wait()


async def test_fulmen_train_killed_mid_run_resumes_with_no_step_lost_or_doubled(
    settings: FulmenSettings, tmp_path: Path
) -> None:
    dataset = tmp_path / "train.jsonl"
    dataset.write_text('{"question": "1 + 1"}\n{"input": {"question": "2 + 2"}, "task_id": "two"}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {
        "FULMEN_KAFKA_BOOTSTRAP": settings.bootstrap,
        "FULMEN_KAFKA_TOPIC_PREFIX": settings.kafka.topic_prefix,
        "FULMEN_HOME": str(tmp_path),
        "FULMEN_TRAIN_GROUP_SIZE": "2",
        "FULMEN_TRAIN_GROUPS_PER_STEP": "1",
        "FULMEN_TRAIN_DEVICE": "cpu",
    }
    run_dir = tmp_path / "runs" / "cli-run"
    args = ["--dataset", str(dataset), "--model", "tiny", "--agent", "agents:solve", "--run", "cli-run", "--steps", "3"]
    stop, killed = asyncio.Event(), asyncio.Event()
    hold = lambda: not killed.is_set() and first_step_done(run_dir)  # noqa: E731
    runners = asyncio.create_task(simulated_runners(settings, stop, hold))
    try:
        await killed_after_first_step(env, run_dir, *args)
        killed.set()
        again = await fulmen_train(env, *args)  # the same command: resumes from the latest checkpoint
        finished = await fulmen_train(env, *args)  # nothing left to do: refused, saying how to go on
    finally:
        stop.set()
        await asyncio.wait_for(runners, 60)
    assert again[0] == 0, again[2]
    assert finished[0] == 1 and "is finished" in finished[2] and "--steps N above 3" in finished[2]
    versions = await read_topic(settings, TopicKey.MODELS, ModelVersion)
    assert [(v.version, v.uri) for v in versions] == [(n, str(run_dir / "checkpoints" / f"v{n}")) for n in (1, 2, 3)]
    assert {v.base_model for v in versions} == {str(run_dir / "base-model")}  # --model tiny built it there
    steps = await read_topic(settings, TopicKey.METRICS, TrainStep)
    trained = [s.step for s in steps]  # step 2's metrics are lost if the kill fell between its save and its publish
    assert len(trained) == len(set(trained)) and {1, 3} <= set(trained) <= {1, 2, 3}
    assert [p.parent.name for p in run_dir.glob("checkpoints/v*/training_state.pt")] == ["v3"]  # the latest only
    assert (run_dir / "curves.png").is_file() and (run_dir / "train_settings.json").is_file()
