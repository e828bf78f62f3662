"""The feedback worker: ``Feedback`` events → their targets resolved in the store → rows of the feedback table.

Lifecycle of a feedback record:

1. decode it (an undecodable record is dead-lettered at once);
2. look its target up (``resolver``), together with every other feedback due in the same round: one query;
3. found: its rows go into the feedback table (one Arrow insert per round); it is done;
4. not found yet (the call's spans may reach the store a little after the feedback): it waits and is looked up
   again, the wait doubling from ``retry_first_s`` up to ``retry_max_s``, until its *deadline*:
   ``resolve_grace_s`` after its timestamp (after the moment it was read, if that is earlier: a timestamp in the
   future does not hold it back);
5. past the deadline, it waits once more for the *barrier*: the end offsets of the spans and rollouts topics are
   taken, and the spans and rollouts consumers' groups must commit past them (they commit only after their
   inserts), so everything published by then is in the store, even when those consumers were behind (a restart
   after a crash, a backlog). Then it is looked up a last time, and if still not found it is dead-lettered with
   the reason ("no LLM call with response id X in the store"): kept, never dropped.

A record waiting for its target does not hold up the others: rounds go on, and offsets are committed per
partition up to the lowest record not done (:class:`~fulmen.infra.kafka.offsets.OffsetTracker`), after the insert
and after the dead-letter topic acknowledged what was sent there. A crash or a rebalance reads the records after
the commit again: a feedback stored twice is one row (the table's key holds its id). Store and broker failures are
retried with backoff until they succeed or ``stop`` is set. All of it runs in one task, so a rebalance (which runs
inside the poll) never meets a half-done round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord, TopicPartition

from fulmen.consumers.barrier import Snapshot, behind
from fulmen.consumers.feedback.resolver import Resolved, Target, TargetResolver
from fulmen.consumers.feedback.settings import FeedbackSection
from fulmen.consumers.tracked import Fetched, TrackedWorker, WorkerStats
from fulmen.infra.kafka.dlq import DeadLetters
from fulmen.infra.kafka.offsets import OffsetTracker
from fulmen.infra.retry import STOPPED, backoff_s
from fulmen.infra.store import Store
from fulmen.schemas.codec import decode
from fulmen.schemas.ddl import TABLES
from fulmen.schemas.errors import PoisonInputError
from fulmen.schemas.events import Feedback, FeedbackTarget

__all__ = ["FEEDBACK_SCHEMA", "Barrier", "FeedbackStats", "FeedbackWorker", "UnknownTargetError", "feedback_rows"]

log = logging.getLogger(__name__)

_BARRIER_CHECK_S = 0.5  # how often a feedback past its deadline looks whether the consumers have caught up
_BARRIER_WARN_S = 30.0  # ... and after how long of that a WARNING says they are behind


class UnknownTargetError(PoisonInputError):
    """A feedback's target is not in the store, after the grace and once the consumers caught up."""


_TS6 = pa.timestamp("us", tz="UTC")
FEEDBACK_SCHEMA = pa.schema(
    [
        ("FeedbackId", pa.string()),
        ("Target", pa.string()),
        ("TargetId", pa.string()),
        ("RolloutId", pa.string()),
        ("Attempt", pa.uint32()),
        ("TraceId", pa.string()),
        ("SpanId", pa.string()),
        ("Name", pa.string()),
        ("Value", pa.float64()),
        ("Comment", pa.string()),
        ("Source", pa.string()),
        ("Timestamp", _TS6),
    ]
)


def feedback_rows(feedback: Feedback, resolved: Sequence[Resolved]) -> list[dict[str, Any]]:
    """One row per call or episode the feedback scores."""
    return [
        {
            "FeedbackId": feedback.feedback_id,
            "Target": feedback.target.value,
            "TargetId": feedback.target_id,
            "RolloutId": r.rollout_id,
            "Attempt": r.attempt,
            "TraceId": r.trace_id,
            "SpanId": r.span_id,
            "Name": feedback.name,
            "Value": feedback.value,
            "Comment": feedback.comment,
            "Source": feedback.source,
            "Timestamp": feedback.timestamp,
        }
        for r in resolved
    ]


def not_found(feedback: Feedback, grace_s: float) -> str:
    """Why a feedback is dead-lettered, for people."""
    what = {
        FeedbackTarget.RESPONSE: f"no LLM call with response id {feedback.target_id}",
        FeedbackTarget.ROLLOUT: f"no rollout {feedback.target_id}",
        FeedbackTarget.TRACE: f"no span of trace {feedback.target_id}",
    }[feedback.target]
    return (
        f"{what} in the store (feedback {feedback.feedback_id}, {feedback.name}={feedback.value:g}; looked until "
        f"{grace_s:g}s after it was sent, and until the spans and rollouts consumers had stored what was "
        "published by then)"
    )


class Barrier(Protocol):
    """The spans and rollouts consumers' progress (:class:`~fulmen.consumers.feedback.app.StoreBarrier`)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def snapshot(self) -> Snapshot: ...

    async def committed(self) -> Snapshot: ...


class Resolver(Protocol):
    def resolve(self, targets: Iterable[Target]) -> dict[Target, list[Resolved]]: ...


@dataclass
class Waiting:
    """A feedback read and not done: when to look it up next, and whether it is past its deadline."""

    tp: TopicPartition
    record: ConsumerRecord
    feedback: Feedback
    deadline: float  # clock seconds: past this, a miss waits for the barrier, then is final
    next_at: float  # clock seconds: when to look it up (again)
    misses: int = 0
    snapshot: Snapshot | None = None  # the topics' end offsets taken once past the deadline
    cleared: bool = False  # the consumers stored everything below ``snapshot``: the next miss is final

    @property
    def target(self) -> Target:
        return (self.feedback.target, self.feedback.target_id)


@dataclass
class FeedbackStats(WorkerStats):
    resolved: int = 0  # feedback stored
    rows: int = 0
    lookups: int = 0  # rounds that queried the store


class FeedbackWorker(TrackedWorker):
    """Runs over a started consumer subscribed to the feedback topic (with :meth:`listener`)."""

    name = "feedback"

    def __init__(
        self,
        sink: Any,
        consumer: AIOKafkaConsumer,
        store: Store,
        dead_letters: DeadLetters,
        barrier: Barrier,
        section: FeedbackSection,
        *,
        resolver: Resolver | None = None,
        retry_backoff_s: float = 0.5,
        clock: Callable[[], float] = time.time,  # wall clock: deadlines come from the feedback's timestamp
    ) -> None:
        super().__init__(
            sink,
            consumer,
            OffsetTracker(),
            FeedbackStats(),
            max_batch=section.max_batch,
            dead_letters=dead_letters,
            retry_backoff_s=retry_backoff_s,
            clock=clock,
            logger=log,
        )
        self.store = store
        self.barrier = barrier
        self.section = section
        self.resolver = resolver or TargetResolver(store)
        self.waiting: dict[tuple[TopicPartition, int], Waiting] = {}
        self._warned_at = 0.0

    async def start(self) -> None:
        await self.barrier.start()

    async def close(self) -> None:
        await self.barrier.stop()

    def full(self) -> bool:
        return len(self.waiting) >= self.section.max_pending

    def poll_ms(self) -> int:
        """Up to 200 ms, less when a waiting feedback is due sooner."""
        if not self.waiting:
            return 200
        soonest = min(waiting.next_at for waiting in self.waiting.values())
        return int(min(200.0, max(10.0, (soonest - self.clock()) * 1000)))

    async def take(self, fetched: Fetched, stop: asyncio.Event) -> None:
        for tp, records in fetched.items():
            for record in records:
                await self._read(tp, record)

    async def work(self, stop: asyncio.Event) -> None:
        """Look up what is due: store and dead-letter."""
        now = self.clock()
        due = [waiting for waiting in self.waiting.values() if waiting.next_at <= now]
        if due:
            await self._round(due, stop)

    async def _read(self, tp: TopicPartition, record: ConsumerRecord) -> None:
        try:
            feedback = decode(
                Feedback, record.value, topic=record.topic, partition=record.partition, offset=record.offset
            )
        except PoisonInputError as exc:
            await self.dead_letter(tp, record, exc)
            return
        now = self.clock()
        deadline = min(feedback.timestamp.timestamp(), now) + self.section.resolve_grace_s
        self.waiting[(tp, record.offset)] = Waiting(tp, record, feedback, deadline, next_at=now)

    # --- a round: look up, store, wait or dead-letter -----------------------------------------------------------
    async def _round(self, due: list[Waiting], stop: asyncio.Event) -> None:
        if not await self._check_barrier(due, stop):
            return
        lookup = [waiting for waiting in due if waiting.snapshot is None or waiting.cleared]
        if not lookup:
            return
        found = await self.retrying(
            lambda: asyncio.to_thread(self.resolver.resolve, {w.target for w in lookup}), "looking targets up", stop
        )
        if found is STOPPED:
            return
        self.stats.lookups += 1
        now, stored, expired = self.clock(), [], []
        for waiting in lookup:
            resolved = found.get(waiting.target)
            if resolved:
                stored.append((waiting, resolved))
            elif waiting.cleared:
                error = UnknownTargetError(not_found(waiting.feedback, self.section.resolve_grace_s))
                await self.dead_letter(waiting.tp, waiting.record, error)
            elif now >= waiting.deadline:
                expired.append(waiting)
            else:
                waiting.misses += 1
                wait = backoff_s(waiting.misses - 1, self.section.retry_first_s, self.section.retry_max_s)
                waiting.next_at = min(waiting.deadline, now + wait)
        if stored and not await self._store(stored, stop):
            return
        if expired:
            snapshot = await self.retrying(self.barrier.snapshot, "reading the spans and rollouts end offsets", stop)
            if snapshot is STOPPED:
                return
            for waiting in expired:
                waiting.snapshot, waiting.next_at = snapshot, now

    async def _check_barrier(self, due: list[Waiting], stop: asyncio.Event) -> bool:
        """Clear the feedback past its deadline whose snapshot the consumers' commits reached; False when stopped."""
        expecting = [waiting for waiting in due if waiting.snapshot is not None and not waiting.cleared]
        if not expecting:
            return True
        committed = await self.retrying(self.barrier.committed, "reading the spans and rollouts groups' offsets", stop)
        if committed is STOPPED:
            return False
        now, lagging, still = self.clock(), {}, 0
        for waiting in expecting:
            gap = behind(waiting.snapshot or {}, committed)
            waiting.cleared = not gap
            if gap:
                lagging.update(gap)
                still += 1
                waiting.next_at = now + _BARRIER_CHECK_S
        if lagging and now - self._warned_at >= _BARRIER_WARN_S:
            self._warned_at = now
            shown = ", ".join(f"{tp.topic}[{tp.partition}] by {gap}" for tp, gap in sorted(lagging.items()))
            log.warning(
                "feedback: %d feedback(s) not found past their grace wait for the spans and rollouts "
                "consumers to store what was published before; behind on %s",
                still,
                shown,
            )
        return True

    async def _store(self, stored: list[tuple[Waiting, list[Resolved]]], stop: asyncio.Event) -> bool:
        """Insert the rows of the resolved feedback, then mark it done; False when stopped first."""
        rows = [row for waiting, resolved in stored for row in feedback_rows(waiting.feedback, resolved)]
        table = pa.Table.from_pylist(rows, schema=FEEDBACK_SCHEMA)
        inserted = await self.retrying(
            lambda: asyncio.to_thread(self.store.insert_batch, TABLES["feedback"], table), "inserting feedback", stop
        )
        if inserted is STOPPED:
            return False
        for waiting, _ in stored:
            self.done(waiting.tp, waiting.record.offset)
        self.stats.resolved += len(stored)
        self.stats.rows += len(rows)
        log.info("feedback: %d stored (%d row(s)); %d wait for their target", len(stored), len(rows), len(self.waiting))
        return True

    def done(self, tp: TopicPartition, offset: int) -> None:
        self.waiting.pop((tp, offset), None)
        super().done(tp, offset)

    def forget(self, partitions: list[TopicPartition]) -> None:
        gone = set(partitions)
        self.waiting = {key: waiting for key, waiting in self.waiting.items() if waiting.tp not in gone}
