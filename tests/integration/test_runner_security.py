"""Issue 11, against a real broker and store: a retried (superseded) attempt never reaches training."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from algorithm.collector import Collector
from algorithm.dispatcher import DispatchedGroup
from algorithm.groups import ClosedGroup, GroupBook
from consumers.transitions import TransitionsSection
from infra.kafka.clients import consumer, start_or_raise
from infra.settings import FulmenSettings
from infra.store import Store
from schemas.events import RolloutMode, RolloutStatus
from schemas.topics import TopicKey, topic_name
from tests.integration.test_runner import request, runner_running, submit, wait_terminal
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
            async with runner_running(settings, "tests.integration.test_runner_security:slow_then_flaky",
                                      concurrency=2):  # fmt: skip
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
