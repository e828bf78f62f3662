"""The transitions worker: terminal rollout events → offset barrier → spans from the store → TransitionBatches.

Lifecycle of one poll (up to ``max_batch`` rollout events, handled together):

1. decode each event (an undecodable one is dead-lettered); remember the highest attempt of each rollout;
2. keep the terminal events of the latest attempts (an older attempt's end, or a rollout attempt already built
   and still watched, is only acknowledged);
3. take the spans topic's end offsets and wait until the spans consumer has committed past them (``barrier``);
4. read the rollouts' spans in one query (``reader``), build one batch per rollout (``builder``);
5. insert the transitions' rows into the transitions table, then publish the batches to
   ``fulmen.transitions`` keyed by group id, acknowledged;
6. commit the rollouts offsets once the batches are out *and* their late window has passed (``window``).

Late spans: every ``late_check_interval_s`` the worker asks the store which watched rollouts received spans
since the last check and compares their distinct span counts with what each was built from. A rollout that
grew is rebuilt and its batch inserted and published again, with a newer ``created_at`` (the transitions table
keeps the newest row per call; readers of the topic keep the newest batch of a rollout attempt), and a WARNING
says so. A span later than ``late_window_s`` after the build is not trained on: it stays in ``otel_traces``.

Store or broker failures are retried with backoff until they succeed or ``stop`` is set; nothing is committed
past an event whose batch is not out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pyarrow as pa
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, TopicPartition
from clickhouse_connect.driver.exceptions import ClickHouseError

from consumers.event_sinks import TRANSITION_SCHEMA, transition_rows
from consumers.transitions.barrier import OffsetBarrier
from consumers.transitions.builder import BuildOptions, BuildResult, build_batch
from consumers.transitions.reader import RolloutKey, SpanReader
from consumers.transitions.settings import TransitionsSection
from consumers.transitions.window import AttemptTracker, BuildWindow, Built
from infra.errors import PoisonInputError, RetryableError
from infra.kafka.clients import close_quietly, start_or_raise
from infra.kafka.dlq import DeadLetters
from infra.kafka.publish import EventPublisher
from infra.settings import FulmenSettings
from infra.store import Store
from schemas.codec import decode, encode
from schemas.ddl import TABLES
from schemas.events import RolloutEvent
from schemas.topics import TopicKey, topic

__all__ = ["TransitionStats", "TransitionWorker"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_LATE_SLACK_MS = 5_000  # an insert may become visible this long after its IngestedAt was taken
_STOPPED = object()
_STORE_ERRORS = (ClickHouseError, OSError)  # a ClickHouse server unreachable or refusing: retried
Item = tuple[TopicPartition, ConsumerRecord, RolloutEvent]


@dataclass
class TransitionStats:
    records: int = 0
    batches: int = 0
    transitions: int = 0
    empty_batches: int = 0
    superseded: int = 0
    duplicates: int = 0
    late_rebuilds: int = 0
    dead_lettered: int = 0
    skipped_calls: int = 0
    committed: dict[TopicPartition, int] = field(default_factory=dict)


class TransitionWorker:
    """Runs over a started consumer subscribed to the rollouts topic (with :meth:`listener`)."""

    def __init__(
        self,
        sink: Any,
        settings: FulmenSettings,
        consumer: AIOKafkaConsumer,
        store: Store,
        dead_letters: DeadLetters,
        publisher: EventPublisher,
        barrier: OffsetBarrier,
        section: TransitionsSection,
        *,
        retry_backoff_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sink = sink
        self.settings = settings
        self.consumer = consumer
        self.store = store
        self.dead_letters = dead_letters
        self.publisher = publisher
        self.barrier = barrier
        self.section = section
        self.options = BuildOptions.create(section.agent_pattern, section.credit, section.gamma)
        self.reader = SpanReader(store)
        self.retry_backoff_s = retry_backoff_s
        self.clock = clock
        self.window = BuildWindow()
        self.attempts = AttemptTracker()
        self.stats = TransitionStats()
        self.max_batch_bytes = int(topic(TopicKey.TRANSITIONS).config.get("max.message.bytes", 1024 * 1024))
        self._since_ms: int | None = None
        self._next_check = 0.0

    def listener(self) -> ConsumerRebalanceListener:
        return _CommitOnRevoke(self)

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set; commit what may be committed before returning."""
        await start_or_raise(self.publisher.producer, self.settings, "transitions producer")
        try:
            await self.barrier.start()
            while not stop.is_set():
                await self.poll_once(stop)
            await self.commit()
        finally:
            await self.barrier.stop()
            await close_quietly([self.publisher.producer])

    async def poll_once(self, stop: asyncio.Event) -> None:
        fetched = await self.consumer.getmany(timeout_ms=200, max_records=self.section.max_batch)
        items = []
        for tp, records in fetched.items():
            for record in records:
                item = await self._read(tp, record)
                if item is not None:
                    items.append(item)
        todo = [item for item in items if self._wanted(item)]
        if todo:
            await self._build_round(todo, stop)
        if self.section.late_window_s > 0 and self.clock() >= self._next_check and not stop.is_set():
            self._next_check = self.clock() + self.section.late_check_interval_s
            await self._check_late(stop)
        await self.commit()

    # --- reading events -------------------------------------------------------------------------------------
    async def _read(self, tp: TopicPartition, record: ConsumerRecord) -> Item | None:
        self.window.read(tp, record.offset)
        self.stats.records += 1
        try:
            event = decode(
                RolloutEvent, record.value, topic=record.topic, partition=record.partition, offset=record.offset
            )
        except PoisonInputError as exc:
            await self._dead_letter(tp, record, exc)
            return None
        self.attempts.observe(event)
        if not event.status.terminal:
            self.window.done(tp, record.offset, self.clock())
            return None
        return (tp, record, event)

    def _wanted(self, item: Item) -> bool:
        """Whether a terminal event is to be built (after every event of the poll has been observed)."""
        tp, record, event = item
        key = (event.rollout_id, event.attempt)
        if self.attempts.superseded(event):
            self.stats.superseded += 1
            log.info("rollout %s attempt %d superseded by a later attempt: not built", *key)
        elif self.window.has_built(key):
            self.stats.duplicates += 1
        else:
            return True
        self.window.done(tp, record.offset, self.clock())
        return False

    async def _dead_letter(self, tp: TopicPartition, record: ConsumerRecord, error: PoisonInputError) -> None:
        error.topic, error.partition, error.offset = record.topic, record.partition, record.offset
        await self.dead_letters.send(record, error)  # acknowledged before any commit (see commit)
        self.stats.dead_lettered += 1
        self.window.done(tp, record.offset, self.clock())

    # --- building -------------------------------------------------------------------------------------------
    async def _build_round(self, todo: list[Item], stop: asyncio.Event) -> None:
        unique: dict[RolloutKey, Item] = {}
        for item in todo:
            key = (item[2].rollout_id, item[2].attempt)
            if key in unique:  # the same end twice in one poll
                self.stats.duplicates += 1
                self.window.done(item[0], item[1].offset, self.clock())
            else:
                unique[key] = item
        snapshot = await self._retrying(self.barrier.snapshot, "reading the spans topic's end offsets", stop)
        if snapshot is _STOPPED or not await self.barrier.wait(snapshot, stop):  # type: ignore[arg-type]
            return
        published = await self._build_and_publish(list(unique.values()), stop)
        if published is None:
            return
        ready_at = self.clock() + self.section.late_window_s
        for (tp, record, event), result in published:
            self.window.built(Built(event, result.span_count, result.batch.created_at, tp, record), ready_at)
        calls = sum(len(result.batch.transitions) for _, result in published)
        log.info("transitions: %d rollout(s) built, %d transition(s) published", len(published), calls)

    async def _build_and_publish(self, items: list[Item], stop: asyncio.Event) -> list[tuple[Item, BuildResult]] | None:
        """Read, build, insert, publish; None when stopped first. Unbuildable events are dead-lettered."""
        keys = [(event.rollout_id, event.attempt) for _, _, event in items]
        spans = await self._retrying(lambda: asyncio.to_thread(self.reader.spans, keys), "reading spans", stop)
        if spans is _STOPPED:
            return None
        built = []
        for item, key in zip(items, keys, strict=True):
            result = await self._build_one(item, spans.get(key, []))  # type: ignore[union-attr]
            if result is not None:
                built.append((item, result))
        await self.dead_letters.flush()
        if built and not await self._publish([result for _, result in built], stop):
            return None
        return built

    async def _build_one(self, item: Item, spans: list) -> BuildResult | None:
        tp, record, event = item
        try:
            result = build_batch(event, spans, self.options)
            size = len(encode(result.batch))
            if size > self.max_batch_bytes:
                raise PoisonInputError(
                    f"its TransitionBatch is {size} bytes, over the transitions topic's {self.max_batch_bytes}",
                    rollout_id=event.rollout_id,
                )
        except (ValueError, PoisonInputError) as exc:
            error = exc if isinstance(exc, PoisonInputError) else PoisonInputError(f"cannot build: {exc}")
            log.error("rollout %s attempt %d: %s; dead-lettered", event.rollout_id, event.attempt, error.message)
            self.window.unwatch((event.rollout_id, event.attempt))
            await self._dead_letter(tp, record, error)
            return None
        for reason in result.skipped:
            log.warning("rollout %s attempt %d: call skipped: %s", event.rollout_id, event.attempt, reason)
        self.stats.skipped_calls += len(result.skipped)
        log.debug(
            "rollout %s attempt %d %s: %d spans, %d calls made, %d selected, %d grafted, %d rewards unmatched",
            event.rollout_id, event.attempt, event.status.value, result.span_count, result.calls_made,
            len(result.batch.transitions), result.grafted, result.unmatched_rewards,
        )  # fmt: skip
        return result

    async def _publish(self, results: list[BuildResult], stop: asyncio.Event) -> bool:
        """Rows into the transitions table, then the batches to Kafka (acknowledged); False when stopped."""
        rows = [row for result in results for row in transition_rows(result.batch)]
        if rows:
            table = pa.Table.from_pylist(rows, schema=TRANSITION_SCHEMA)
            inserted = await self._retrying(
                lambda: asyncio.to_thread(self.store.insert_arrow, TABLES["transitions"], table),
                "inserting transitions", stop,
            )  # fmt: skip
            if inserted is _STOPPED:
                return False
        batches = [result.batch for result in results]
        sent = await self._retrying(
            lambda: self.publisher.publish_many(TopicKey.TRANSITIONS, batches), "publishing transitions", stop
        )
        if sent is _STOPPED:
            return False
        self.stats.batches += len(batches)
        self.stats.transitions += len(rows)
        self.stats.empty_batches += sum(1 for batch in batches if not batch.transitions)
        return True

    # --- late spans -----------------------------------------------------------------------------------------
    async def _check_late(self, stop: asyncio.Event) -> None:
        watched = self.window.watched()
        now_ms = await self._retrying(lambda: asyncio.to_thread(self.reader.now_ms), "reading the store clock", stop)
        if now_ms is _STOPPED:
            return
        since, self._since_ms = self._since_ms, now_ms  # type: ignore[assignment]
        if not watched:
            return
        since = (since if since is not None else now_ms - int(self.section.late_window_s * 1000)) - _LATE_SLACK_MS
        try:
            recent = await asyncio.to_thread(self.reader.recently_ingested, since)
            candidates = [key for key in recent if key in watched]
            counts = await asyncio.to_thread(self.reader.span_counts, candidates) if candidates else {}
        except _STORE_ERRORS as exc:
            log.warning("transitions: the late-span check failed, trying again next time: %s", exc)
            self._since_ms = since + _LATE_SLACK_MS
            return
        late = [key for key in candidates if counts.get(key, 0) > watched[key].span_count]
        if late:
            await self._rebuild(late, counts, stop)

    async def _rebuild(self, late: list[RolloutKey], counts: dict[RolloutKey, int], stop: asyncio.Event) -> None:
        watched = self.window.watched()
        items = [(watched[key].tp, watched[key].record, watched[key].event) for key in late]
        published = await self._build_and_publish(items, stop)
        if published is None:
            return
        ready_at = self.clock() + self.section.late_window_s
        for (tp, record, event), result in published:
            key = (event.rollout_id, event.attempt)
            log.warning(
                "rollout %s attempt %d: %d span(s) arrived after its transitions were built; rebuilt with %d "
                "transition(s) and published again", key[0], key[1], counts[key] - watched[key].span_count,
                len(result.batch.transitions),
            )  # fmt: skip
            self.window.built(Built(event, result.span_count, result.batch.created_at, tp, record), ready_at)
        self.stats.late_rebuilds += len(published)

    # --- committing -----------------------------------------------------------------------------------------
    async def commit(self, partitions: list[TopicPartition] | None = None) -> None:
        """Commit the offsets that are done and past their window (of ``partitions``, or all owned)."""
        await self.dead_letters.flush()
        owned = self.consumer.assignment()
        ready = self.window.committable(self.clock(), partitions)
        mine = {tp: OffsetAndMetadata(offset, "") for tp, offset in ready.items() if tp in owned}
        if not mine:
            return
        try:
            await self.consumer.commit(mine)
        except (CommitFailedError, IllegalStateError) as exc:
            log.warning("transitions: commit refused after a rebalance; the new owner re-reads these: %s", exc)
            return
        except KafkaError as exc:
            raise RetryableError(f"transitions: commit failed: {exc}") from exc
        self.stats.committed.update({tp: m.offset for tp, m in mine.items()})

    async def _retrying(self, fn: Callable[[], Awaitable[T]], what: str, stop: asyncio.Event) -> T | object:
        attempt = 0
        while not stop.is_set():
            try:
                return await fn()
            except (RetryableError, KafkaError, *_STORE_ERRORS) as exc:
                attempt += 1
                delay = min(30.0, self.retry_backoff_s * 2 ** min(attempt, 6))
                log.warning("transitions: %s failed (attempt %d), retrying in %.1fs: %s", what, attempt, delay, exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
        return _STOPPED


class _CommitOnRevoke(ConsumerRebalanceListener):
    def __init__(self, owner: TransitionWorker) -> None:
        self.owner = owner

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        if revoked:
            await self.owner.commit(list(revoked))
            self.owner.window.forget(list(revoked))

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        log.debug("transitions: assigned %s", sorted(assigned))
