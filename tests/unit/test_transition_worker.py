"""The transitions worker's acknowledgement policy against in-memory fakes (the real broker: integration tests)."""

from __future__ import annotations

import asyncio
from typing import Any

import pyarrow as pa
from aiokafka.structs import TopicPartition

from fulmen.consumers.transitions import TransitionBuilderSink, TransitionsSection, TransitionWorker
from fulmen.infra.kafka.dlq import DeadLetters
from fulmen.infra.kafka.publish import EventPublisher
from fulmen.schemas import RolloutEvent, RolloutStatus, TransitionBatch, encode
from fulmen.schemas.codec import decode
from fulmen.schemas.errors import RetryableError
from tests.fakes import FakeBroker, FakeProducer, PausingConsumer
from tests.unit.transition_spans import call, span

ROLLOUTS = "fulmen.rollouts"
SPANS = TopicPartition("otlp_spans", 0)


class FakeBarrier:
    spans_group = "fulmen.consumers.spans"

    def __init__(self) -> None:
        self.end = 0
        self.commit = 0

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def snapshot(self) -> dict[TopicPartition, int]:
        return {SPANS: self.end}

    async def committed(self) -> dict[TopicPartition, int]:
        return {SPANS: self.commit}


class FakeStore:
    embedded = True

    def __init__(self, events: list[str], failures: int = 0) -> None:
        self.events = events
        self.failures = failures
        self.rows: list[dict[str, Any]] = []

    def table(self, name: str) -> str:
        return f"db.{name}"

    def insert_arrow(self, table: str, data: pa.Table) -> int:
        if self.failures:
            self.failures -= 1
            self.events.append("insert-failed")
            raise RetryableError("store down (fake)")
        self.rows.extend(data.to_pylist())
        self.events.append("insert")
        return data.num_rows


class FakeReader:
    def __init__(self) -> None:
        self.by_rollout: dict[tuple[str, int], list] = {}

    def spans(self, keys: list[tuple[str, int]]) -> dict[tuple[str, int], list]:
        return {key: self.by_rollout[key] for key in keys if key in self.by_rollout}

    def now_ms(self) -> int:
        return 0

    def recently_ingested(self, rollout_ids: set[str], since_ms: int) -> set[tuple[str, int]]:
        return set()  # no late span (the late check itself: test_transition_builder, integration)


def ended(rollout: str, status: RolloutStatus = RolloutStatus.SUCCEEDED, attempt: int = 1) -> bytes:
    error = None if status in (RolloutStatus.SUCCEEDED, RolloutStatus.CLAIMED) else "boom"
    reward = 1.0 if status is RolloutStatus.SUCCEEDED else None
    return encode(
        RolloutEvent(
            rollout_id=rollout, attempt=attempt, status=status, task_id="t", group_id="g", reward=reward, error=error
        )
    )


def build(
    late_window_s: float = 0.0, failures: int = 0, build_interval_s: float = 0.0
) -> tuple[TransitionWorker, dict[str, Any]]:
    consumer = PausingConsumer()
    producer = FakeProducer(consumer.events)
    store = FakeStore(consumer.events, failures)
    barrier = FakeBarrier()
    now = [0.0]
    section = TransitionsSection(
        late_window_s=late_window_s, late_check_interval_s=3600, build_interval_s=build_interval_s
    )
    worker = TransitionWorker(
        TransitionBuilderSink(section),
        None,
        consumer,
        store,
        DeadLetters(producer, consumer_group="g"),  # type: ignore[arg-type]
        EventPublisher(FakeBroker(producer)),
        barrier,
        section,
        retry_backoff_s=0.001,
        clock=lambda: now[0],  # type: ignore[arg-type]
    )
    reader = FakeReader()
    worker.reader = worker.late.reader = reader  # type: ignore[assignment]
    for i in range(3):
        reader.by_rollout[(f"r{i}", 1)] = [span("agent", 0, 100, agent="solver"), call(f"c{i}", 10, 20, "agent")]
    return worker, {"consumer": consumer, "producer": producer, "store": store, "barrier": barrier, "now": now}


def batches(producer: FakeProducer) -> list[TransitionBatch]:
    return [decode(TransitionBatch, sent["value"]) for sent in producer.sent if sent["topic"].endswith("transitions")]


async def test_rollouts_wait_for_the_barrier_while_polling_goes_on() -> None:
    worker, fx = build()
    stop = asyncio.Event()
    consumer, barrier = fx["consumer"], fx["barrier"]
    barrier.end = 5
    consumer.append(ROLLOUTS, 0, ended("r0"))
    await worker.poll_once(stop)
    barrier.end = 9
    consumer.append(ROLLOUTS, 0, ended("r1"))
    await worker.poll_once(stop)
    assert len(worker.waiting) == 2 and batches(fx["producer"]) == [] and consumer.committed == {}
    barrier.commit = 5  # the spans consumer stored what existed when r0 ended, not yet r1's
    await worker.poll_once(stop)
    assert [b.rollout_id for b in batches(fx["producer"])] == ["r0"]
    assert consumer.committed == {TopicPartition(ROLLOUTS, 0): 1}
    barrier.commit = 9
    await worker.poll_once(stop)
    assert [b.rollout_id for b in batches(fx["producer"])] == ["r0", "r1"]
    assert consumer.committed == {TopicPartition(ROLLOUTS, 0): 2}
    assert [row["RolloutId"] for row in fx["store"].rows] == ["r0", "r1"]


async def test_builds_are_spaced_by_the_interval_and_a_build_takes_everything_released_meanwhile() -> None:
    worker, fx = build(build_interval_s=2.0)
    stop = asyncio.Event()
    consumer, barrier, now = fx["consumer"], fx["barrier"], fx["now"]
    barrier.end = barrier.commit = 1
    consumer.append(ROLLOUTS, 0, ended("r0"))
    await worker.poll_once(stop)
    assert [b.rollout_id for b in batches(fx["producer"])] == ["r0"]  # the first build goes at once
    for name, at in (("r1", 0.5), ("r2", 1.5)):
        now[0] = at
        consumer.append(ROLLOUTS, 0, ended(name))
        await worker.poll_once(stop)
    assert [b.rollout_id for b in batches(fx["producer"])] == ["r0"] and len(worker.waiting) == 2
    now[0] = 2.0  # the interval has passed: one build of both
    await worker.poll_once(stop)
    assert [b.rollout_id for b in batches(fx["producer"])] == ["r0", "r1", "r2"] and not len(worker.waiting)
    assert consumer.committed == {TopicPartition(ROLLOUTS, 0): 3}
    assert worker.poll_ms() == 200  # nothing waits: the usual poll


async def test_rows_are_inserted_then_published_then_committed_and_a_failed_insert_is_retried() -> None:
    worker, fx = build(failures=2)
    consumer = fx["consumer"]
    consumer.append(ROLLOUTS, 0, ended("r0", RolloutStatus.CLAIMED))
    consumer.append(ROLLOUTS, 0, ended("r0"))
    await worker.poll_once(asyncio.Event())
    assert consumer.events == ["insert-failed", "insert-failed", "insert", "dlq-send", "commit"]  # send: the batch
    assert consumer.committed == {TopicPartition(ROLLOUTS, 0): 2}


async def test_the_late_window_holds_the_commit_back() -> None:
    worker, fx = build(late_window_s=60)
    consumer, now = fx["consumer"], fx["now"]
    consumer.append(ROLLOUTS, 0, ended("r0"))
    consumer.append(ROLLOUTS, 0, ended("r1", RolloutStatus.CLAIMED))
    await worker.poll_once(asyncio.Event())
    assert len(batches(fx["producer"])) == 1 and consumer.committed == {}
    assert list(worker.window.watched()) == [("r0", 1)]
    now[0] = 61.0
    await worker.poll_once(asyncio.Event())
    assert consumer.committed == {TopicPartition(ROLLOUTS, 0): 2} and not worker.window.watched()


async def test_old_attempts_duplicates_and_poison_are_acknowledged_without_a_build() -> None:
    worker, fx = build()
    consumer = fx["consumer"]
    consumer.append(ROLLOUTS, 0, ended("r0", RolloutStatus.CLAIMED, attempt=2))
    consumer.append(ROLLOUTS, 0, ended("r0", RolloutStatus.FAILED, attempt=1))
    consumer.append(ROLLOUTS, 0, ended("r1"))
    consumer.append(ROLLOUTS, 0, ended("r1"))
    consumer.append(ROLLOUTS, 0, b"not json")
    await worker.poll_once(asyncio.Event())
    assert [b.rollout_id for b in batches(fx["producer"])] == ["r1"]
    assert (worker.stats.superseded, worker.stats.duplicates, worker.stats.dead_lettered) == (1, 1, 1)
    assert consumer.committed == {TopicPartition(ROLLOUTS, 0): 5}


async def test_fetching_pauses_while_too_many_rounds_wait_and_a_revoke_drops_them() -> None:
    worker, fx = build()
    consumer, barrier, stop = fx["consumer"], fx["barrier"], asyncio.Event()
    tp = TopicPartition(ROLLOUTS, 0)
    for i in range(40):  # one end per poll, the spans consumer stuck: a new round each time
        consumer.append(ROLLOUTS, 0, ended(f"w{i}"))
        barrier.end += 1
        await worker.poll_once(stop)
    assert len(worker.waiting) == 32 and consumer.paused() == {tp}  # still polled, so still in the group
    barrier.commit = barrier.end
    await worker.poll_once(stop)
    assert len(batches(fx["producer"])) == 32 and consumer.committed == {tp: 32}
    barrier.end += 1
    await worker.poll_once(stop)  # resumed: the other 8 ends are fetched, and wait
    assert consumer.paused() == set() and len(worker.waiting) == 1
    await worker.revoked([tp])
    assert worker.waiting.release({SPANS: 10**6}) == [] and worker.window.pending() == 0
    assert len(batches(fx["producer"])) == 32


async def test_an_attempt_superseded_while_it_waited_is_not_built() -> None:
    worker, fx = build()
    consumer, barrier, stop = fx["consumer"], fx["barrier"], asyncio.Event()
    barrier.end = 3
    consumer.append(ROLLOUTS, 0, ended("r0", RolloutStatus.FAILED, attempt=1))
    await worker.poll_once(stop)
    consumer.append(ROLLOUTS, 0, ended("r0", RolloutStatus.CLAIMED, attempt=2))
    await worker.poll_once(stop)
    barrier.commit = 3
    await worker.poll_once(stop)
    assert batches(fx["producer"]) == [] and worker.stats.superseded == 1
    assert consumer.committed == {TopicPartition(ROLLOUTS, 0): 2}


async def test_the_feed_is_used_only_for_rollouts_claimed_after_its_mark_in_the_same_epoch() -> None:
    """Claimed before the mark (spans maybe consumed before the feed covered), or across a change of the spans
    consumer's assignment: read back from the store. Claimed at or past the mark, within the epoch: the feed."""
    from types import SimpleNamespace

    from fulmen.consumers.transitions.feed import SpanFeed
    from tests.unit.test_span_feed import record

    worker, fx = build()
    consumer, barrier = fx["consumer"], fx["barrier"]
    feed = worker.feed = SpanFeed()
    worker.settings = SimpleNamespace(kafka=SimpleNamespace(topic_prefix=""))  # type: ignore[assignment]
    consumer.partitions_for_topic = lambda name: {0}
    barrier.spans_partitions = lambda: _returning([SPANS])
    barrier.end_offsets = lambda topic, partitions: _returning({p: consumer_end(consumer) for p in partitions})
    stop = asyncio.Event()
    consumer.append(ROLLOUTS, 0, ended("r0", RolloutStatus.CLAIMED))  # offset 0: before the feed covers
    feed.assigned([SPANS])
    await worker.poll_once(stop)
    assert worker.feed_ready  # marked at offset 1
    consumer.append(ROLLOUTS, 0, ended("r1", RolloutStatus.CLAIMED))
    feed.add([record("r0", "a"), record("r1", "a")])
    consumer.append(ROLLOUTS, 0, ended("r0"))
    consumer.append(ROLLOUTS, 0, ended("r1"))
    await worker.poll_once(stop)
    await worker.poll_once(stop)
    assert (worker.stats.from_feed, worker.stats.from_store) == (1, 1) and len(feed) == 0
    consumer.append(ROLLOUTS, 0, ended("r2", RolloutStatus.CLAIMED))
    feed.add([record("r2", "a")])
    feed.revoked([SPANS])  # the spans consumer's assignment changed: r2's spans may be elsewhere
    feed.assigned([SPANS])
    consumer.append(ROLLOUTS, 0, ended("r2"))
    await worker.poll_once(stop)
    await worker.poll_once(stop)
    assert (worker.stats.from_feed, worker.stats.from_store) == (1, 2)
    assert worker.feed_ready  # marked again in the new epoch
    assert [b.rollout_id for b in batches(fx["producer"])] == ["r0", "r1", "r2"]


async def _returning(value: Any) -> Any:
    return value


def consumer_end(consumer: Any) -> int:
    return len(consumer.log[TopicPartition(ROLLOUTS, 0)])
