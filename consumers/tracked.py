"""What every consumer that tracks its own offsets shares: the poll loop, back-pressure, commits, rebalances, retries.

``fulmen consume`` runs two kinds of consumer. A table sink's records become rows in one insert per batch
(:class:`~fulmen.consumers.batch.BatchConsumer`, or faststream for the JSON topics). The others hold records
across polls: the transitions consumer until the spans consumer has stored a rollout's spans, the feedback
consumer until a feedback's target is in the store, the production detector until an episode goes idle. They
are :class:`TrackedWorker` subclasses, and only what is theirs differs:

* :meth:`~TrackedWorker.take`: what a poll's records become (each is ``read`` by the tracker first);
* :meth:`~TrackedWorker.work`: what to do between polls (build what the barrier released, look targets up, end
  idle episodes), marking records :meth:`~TrackedWorker.done` as their effects are acknowledged;
* :meth:`~TrackedWorker.full` (pause the partitions, keep polling so the group keeps this member) and
  :meth:`~TrackedWorker.poll_ms` (wake sooner when something is due);
* :meth:`~TrackedWorker.forget` what was held of partitions taken away, and :meth:`~TrackedWorker.start` /
  :meth:`~TrackedWorker.close` for the clients the worker owns.

The base commits, per partition, up to the lowest record not done, after every poll, when partitions are revoked
and before returning (an offset tracker: :class:`~fulmen.infra.kafka.offsets.OffsetTracker`, or one built on it);
a dead letter counts as done only once the dead-letter topic acknowledged it. A crash or a rebalance reads the
records after the last commit again. Store and broker failures are retried with backoff until they succeed or
``stop`` is set. All of it runs in one task, so a rebalance (which aiokafka runs inside the poll) never meets a
half-done round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition
from clickhouse_connect.driver.exceptions import ClickHouseError

from fulmen.infra.kafka.dlq import DeadLetters
from fulmen.infra.kafka.offsets import RebalanceListener, commit_finished
from fulmen.infra.retry import Stopped, retrying
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store
from fulmen.schemas.errors import PoisonInputError, RetryableError

__all__ = ["STORE_ERRORS", "TrackedWorker", "Worker", "WorkerContext", "WorkerStats"]

T = TypeVar("T")
Fetched = dict[TopicPartition, list[ConsumerRecord]]

STORE_ERRORS = (ClickHouseError, OSError)  # a ClickHouse server unreachable or refusing: retried


@dataclass
class WorkerStats:
    """What every consumer counts (each adds its own): records read, records dead-lettered, and the offsets last
    committed per partition."""

    records: int = 0
    dead_lettered: int = 0
    committed: dict[TopicPartition, int] = field(default_factory=dict)


@runtime_checkable
class Worker(Protocol):
    """What ``ConsumersApp`` runs for a sink that is not a plain table sink: subscribe its consumer with
    :meth:`listener`, then :meth:`run` it until ``stop`` is set."""

    sink: Any
    stats: WorkerStats

    def listener(self) -> ConsumerRebalanceListener: ...

    async def run(self, stop: asyncio.Event) -> None: ...


@dataclass(frozen=True)
class WorkerContext:
    """What ``ConsumersApp`` offers a sink making its worker (each takes what it uses)."""

    settings: FulmenSettings
    consumer: AIOKafkaConsumer
    store: Store
    dead_letters: DeadLetters
    group_prefix: str


class TrackedWorker:
    """A consumer loop over a started ``consumer`` subscribed with :meth:`listener`; see the module docstring.

    ``offsets``: the tracker the commits read (``read``, ``done``, ``committable``, ``committed``, ``forget``).
    ``name`` prefixes its logs and names it to the rebalance listener; ``max_batch`` bounds a poll.
    """

    name = "worker"
    retry_on: tuple[type[BaseException], ...] = (RetryableError, KafkaError, *STORE_ERRORS)

    def __init__(
        self,
        sink: Any,
        consumer: AIOKafkaConsumer,
        offsets: Any,
        stats: WorkerStats,
        *,
        max_batch: int,
        dead_letters: DeadLetters | None = None,
        retry_backoff_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger | None = None,
    ) -> None:
        self.sink = sink
        self.consumer = consumer
        self.offsets = offsets
        self.stats = stats
        self.max_batch = max_batch
        self.dead_letters = dead_letters
        self.retry_backoff_s = retry_backoff_s
        self.clock = clock
        self.log = logger or logging.getLogger(type(self).__module__)

    # --- what a worker defines ----------------------------------------------------------------------------------
    async def take(self, fetched: Fetched, stop: asyncio.Event) -> None:
        """A poll's records, each already read by the tracker."""

    async def work(self, stop: asyncio.Event) -> None:
        """Between polls (not called once ``stop`` is set)."""

    def full(self) -> bool:
        """True while the worker holds as much as it may: fetching pauses (polling goes on)."""
        return False

    def poll_ms(self) -> int:
        """How long a poll may wait for records."""
        return 200

    def forget(self, partitions: list[TopicPartition]) -> None:
        """Drop what is held of ``partitions`` (the tracker forgets them too)."""

    async def start(self) -> None:
        """Start the clients the worker owns."""

    async def close(self) -> None:
        """Close them (also after an error)."""

    # --- the loop -----------------------------------------------------------------------------------------------
    def listener(self) -> ConsumerRebalanceListener:
        """Pass this to ``consumer.subscribe``: it commits what is done before partitions are taken away."""
        return RebalanceListener(self, self.name)

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set; commit what is done before returning (what is held is read again)."""
        await self.start()
        try:
            while not stop.is_set():
                await self.poll_once(stop)
            await self.commit()
        finally:
            await self.close()

    async def poll_once(self, stop: asyncio.Event) -> None:
        """Fetch (unless full), take the records, work, commit."""
        # While full, the partitions are paused but still polled: the group keeps this member.
        if self.full():
            self.consumer.pause(*self.consumer.assignment())
        elif self.consumer.paused():
            self.consumer.resume(*self.consumer.paused())
        fetched = await self.consumer.getmany(timeout_ms=self.poll_ms(), max_records=self.max_batch)
        for tp, records in fetched.items():
            for record in records:
                self.offsets.read(tp, record.offset)
                self.stats.records += 1
        await self.take(fetched, stop)
        if not stop.is_set():
            await self.work(stop)
        await self.commit()

    def done(self, tp: TopicPartition, offset: int) -> None:
        """The record at ``offset`` needs nothing more: it may be committed."""
        self.offsets.done(tp, offset, ready_at=self.clock())

    async def dead_letter(self, tp: TopicPartition, record: ConsumerRecord, error: PoisonInputError) -> None:
        """Send ``record`` to the dead-letter topic with why; it is done once the send is acknowledged."""
        if self.dead_letters is None:
            raise RuntimeError(f"{self.name}: no dead-letter topic to send {record.topic}@{record.offset} to")
        error.topic, error.partition, error.offset = record.topic, record.partition, record.offset
        await self.dead_letters.send(record, error)  # acknowledged before any commit (see commit)
        self.stats.dead_lettered += 1
        self.done(tp, record.offset)

    async def retrying(self, fn: Callable[[], Awaitable[T]], what: str, stop: asyncio.Event) -> T | Stopped:
        """``fn()`` until it succeeds (``retry_on`` errors retried with backoff), or STOPPED once ``stop`` is set."""
        what = f"{self.name}: {what}"
        return await retrying(
            fn, what=what, retry_on=self.retry_on, base_s=self.retry_backoff_s, stop=stop, logger=self.log
        )

    # --- committing and rebalances ------------------------------------------------------------------------------
    async def commit(self, partitions: Iterable[TopicPartition] | None = None) -> None:
        """Commit, per partition, up to the lowest record not done (of ``partitions``, or all owned)."""
        if self.dead_letters is not None:
            await self.dead_letters.flush()  # a dead letter counts as done only once its send is acknowledged
        committed = await commit_finished(
            self.consumer,
            self.offsets,
            what=self.name,
            partitions=None if partitions is None else list(partitions),
            now=self.clock(),
            logger=self.log,
        )
        self.stats.committed.update(committed)

    async def revoked(self, partitions: list[TopicPartition]) -> None:
        """Partitions taken away: commit what is done, then forget them (their next owner reads the rest again)."""
        await self.commit(partitions)
        self._forget(partitions)

    def assigned(self, partitions: list[TopicPartition]) -> None:
        """Partitions given: whatever was known of them is stale (they are read again from the committed offset)."""
        self._forget(partitions)

    def _forget(self, partitions: list[TopicPartition]) -> None:
        self.offsets.forget(partitions)
        self.forget(partitions)
