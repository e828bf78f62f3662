"""Issue 11, against a real broker and store: a retried (superseded) attempt never reaches training; a retry
waits for its backoff while other rollouts run."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider

from fulmen.algorithm.service.collector import Collector
from fulmen.algorithm.service.dispatcher import DispatchedGroup
from fulmen.algorithm.service.groups import ClosedGroup, GroupBook
from fulmen.consumers.transitions import TransitionsSection
from fulmen.infra.kafka.clients import consumer, start_or_raise
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store
from fulmen.producers.runner import Runner, RunnerSettings, load_agent
from fulmen.producers.runner.backoff import not_before
from fulmen.schemas import RolloutRequest
from fulmen.schemas.events import RolloutMode, RolloutStatus
from fulmen.schemas.topics import TopicKey, topic_name
from tests.integration.test_runner import events_by_rollout, request, runner_running, submit, wait_terminal
from tests.integration.test_train_loop import read_topic
from tests.integration.transition_pipeline import BatchReader, builders, consumers_running

pytestmark = [pytest.mark.integration, pytest.mark.security]


def slow_then_flaky(task: dict, llm: object) -> float:
    """Works a second, then fails on the rollout's first attempt (a marker file per rollout); succeeds after."""
    time.sleep(1.0)
    marker = Path(task["dir"]) / f"{task['name']}.tried"
    if not marker.exists():
        marker.write_text("1")
        raise RuntimeError("first try fails")
    return 1.0


async def closed_groups(collector: Collector, timeout_s: float = 90) -> list[ClosedGroup]:
    deadline = time.monotonic() + timeout_s
    closed: list[ClosedGroup] = []
    while not closed and time.monotonic() < deadline:
        closed = await collector.poll()
    return closed


async def test_a_retried_attempt_is_never_built_nor_trained_on(
    settings: FulmenSettings, linked_store: Store, tmp_path: Path
) -> None:
    rollouts = [f"r{i}" for i in range(4)]
    requests = [request(r, {"dir": str(tmp_path), "name": r}, max_attempts=2) for r in rollouts]
    transitions = consumer(settings, "fulmen.trainer", topic_name(TopicKey.TRANSITIONS, settings.kafka.topic_prefix))
    await start_or_raise(transitions, settings)
    collector = Collector(transitions, GroupBook(timeout_s=300), poll_timeout_ms=200)
    collector.expect([DispatchedGroup("g1", "task", RolloutMode.TRAIN, 4, 2, 0, tuple(rollouts))])
    section = TransitionsSection(late_window_s=0)
    try:
        async with consumers_running(settings, linked_store, section) as app, BatchReader(settings) as reader:
            await submit(settings, requests)
            # 2 slots, 4 rollouts of 1 s: the retries wait for a free slot while the first attempts end
            async with runner_running(
                settings, "tests.integration.test_runner_security:slow_then_flaky", concurrency=2
            ):
                events = await wait_terminal(settings, set(rollouts), final=2)
                closed = await closed_groups(collector)
            batches = await reader.until(4)
            superseded = builders(app)[0].stats.superseded
    finally:
        await transitions.stop()
    for rollout in rollouts:  # the rollouts topic says "attempt 2 queued" before "attempt 1 failed"
        statuses = [(e.attempt, e.status) for e in events[rollout]]
        queued, failed = statuses.index((2, RolloutStatus.QUEUED)), statuses.index((1, RolloutStatus.FAILED))
        assert queued < failed, statuses
    assert sorted((b.rollout_id, b.attempt, b.status) for b in batches) == [(r, 2, "succeeded") for r in rollouts]
    assert superseded == 4
    db = linked_store.database
    assert linked_store.query(f"SELECT count() FROM {db}.transitions WHERE Attempt = 1").rows == [[0]]
    (group,) = closed
    assert group.kept and not group.partial
    assert [(r.rollout_id, r.attempt, r.episode_reward) for r in group.rollouts] == [(r, 2, 1.0) for r in rollouts]
    assert collector.older_attempts == 0  # no attempt 1 ever reached the trainer


def fails_once_when_asked(task: dict, llm: object) -> float:
    """Fails the first attempt of a task that says ``fail_once`` (a marker file per task); succeeds otherwise."""
    if task.get("fail_once"):
        marker = Path(task["dir"]) / f"{task['name']}.tried"
        if not marker.exists():
            marker.write_text("1")
            raise RuntimeError("first try fails")
    time.sleep(task.get("sleep", 0))
    return 1.0


@asynccontextmanager
async def backoff_runner(settings: FulmenSettings, agent: str, **runner: object) -> AsyncIterator[Runner]:
    options = RunnerSettings(
        home=settings.home,
        kafka=settings.kafka.model_dump(),
        clickhouse=settings.clickhouse.model_dump(),
        runner={"agent": agent, "otlp_endpoint": "", "shutdown_grace_s": 5, **runner},
    )
    process = Runner(options, load_agent(agent), tracer_provider=TracerProvider())
    stop = asyncio.Event()
    task = asyncio.create_task(process.run(stop))
    try:
        yield process
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


async def tasks_on_topic(settings: FulmenSettings) -> list[RolloutRequest]:
    """Every request on the tasks topic up to its end now."""
    return await read_topic(settings, TopicKey.TASKS, RolloutRequest)


async def test_a_retry_waits_for_its_backoff_while_other_rollouts_run(settings: FulmenSettings, tmp_path: Path) -> None:
    backoff_s = 5.0
    others = {f"other-{i}" for i in range(3)}
    agent = "tests.integration.test_runner_security:fails_once_when_asked"
    # one slot: had the retry taken it while waiting, no other rollout could run before it
    async with backoff_runner(settings, agent, concurrency=1, retry_backoff_s=backoff_s, retry_jitter=0):
        await submit(settings, [request("flaky", {"fail_once": True, "dir": str(tmp_path), "name": "flaky"})])
        await wait_terminal(settings, {"flaky"})
        await submit(settings, [request(r, {"sleep": 0.1}) for r in sorted(others)])
        await wait_terminal(settings, others)
        events = await wait_terminal(settings, {"flaky"}, final=2)
    flaky = {(e.attempt, e.status): e.timestamp for e in events["flaky"]}
    failed, retried = flaky[(1, RolloutStatus.FAILED)], flaky[(2, RolloutStatus.CLAIMED)]
    assert (2, RolloutStatus.SUCCEEDED) in flaky
    assert retried - failed >= timedelta(seconds=backoff_s)  # not started before its backoff
    for other in others:  # and the slot served other rollouts meanwhile
        (ended,) = [e.timestamp for e in events[other] if e.status is RolloutStatus.SUCCEEDED]
        assert failed < ended < retried, (other, failed, ended, retried)
    (retry,) = [r for r in await tasks_on_topic(settings) if r.rollout_id == "flaky" and r.attempt == 2]
    assert not_before(retry) is not None and not_before(retry) >= failed + timedelta(seconds=backoff_s)


async def test_a_held_retry_is_taken_by_another_runner_after_a_restart(
    settings: FulmenSettings, tmp_path: Path
) -> None:
    """The not-before time travels with the request: a runner that stops while holding the retry hands it back
    uncommitted, and the next runner waits for the same time, then runs it."""
    backoff_s = 4.0
    agent = "tests.integration.test_runner_security:fails_once_when_asked"
    async with backoff_runner(settings, agent, retry_backoff_s=backoff_s, retry_jitter=0) as first:
        await submit(settings, [request("flaky", {"fail_once": True, "dir": str(tmp_path), "name": "flaky"})])
        await wait_terminal(settings, {"flaky"})
        deadline = time.monotonic() + 60
        while not first.delayed and time.monotonic() < deadline:  # until it took the retry and holds it
            await asyncio.sleep(0.05)
        assert first.delayed, "the first runner never held the retry"
    assert first.completed["succeeded"] == 0
    async with backoff_runner(settings, agent, retry_backoff_s=backoff_s, retry_jitter=0):
        events = await wait_terminal(settings, {"flaky"}, final=2)
    flaky = {(e.attempt, e.status): e for e in events["flaky"]}
    assert flaky[(2, RolloutStatus.SUCCEEDED)].runner_id != flaky[(1, RolloutStatus.FAILED)].runner_id
    failed, retried = flaky[(1, RolloutStatus.FAILED)].timestamp, flaky[(2, RolloutStatus.CLAIMED)].timestamp
    assert retried - failed >= timedelta(seconds=backoff_s)
    assert len([e for e in (await events_by_rollout(settings))["flaky"] if e.status is RolloutStatus.CLAIMED]) == 2
