"""The batch consumer: Kafka records → decoded units → one Arrow insert → offsets committed.

Lifecycle of a batch: poll until ``max_records`` units, ``max_bytes`` of record values (which bounds the memory
of the insert: the store's working memory grows with the batch) or ``max_wait_s`` since the first one; decode each
record (a record that is poison goes to the dead-letter topic, the stream goes on); insert the batch into the
store as one Arrow table or pre-encoded block (Native) (retried with backoff while the store is down, never skipped)
while the next batch is being polled; wait for the dead-letter sends to be acknowledged; then commit the
offsets, in batch order. A crash anywhere before the commit means the
batch is delivered again, and the tables' ReplacingMergeTree keys make the second write invisible.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.structs import ConsumerRecord, TopicPartition

from fulmen.consumers.metrics import observe_batch
from fulmen.consumers.tracked import WorkerStats
from fulmen.infra.kafka.dlq import DeadLetters
from fulmen.infra.kafka.offsets import RebalanceListener, commit_offsets, describe_offsets
from fulmen.infra.retry import retrying
from fulmen.infra.store import EncodedRows, Store
from fulmen.schemas.errors import PoisonInputError, RetryableError
from fulmen.schemas.topics import TopicKey

__all__ = ["BatchConsumer", "BatchStats", "Sink"]

log = logging.getLogger(__name__)


class Sink(Protocol):
    """Turns the records of one topic into rows of one table.

    ``decode`` works on one record and raises :class:`PoisonInputError` for a record that will never be
    valid; ``to_batch`` turns a batch of decoded units into one insert, an Arrow table or pre-encoded rows (it
    may raise for a unit that cannot be stored, or a PoisonInputError for one a sink decodes only here; the batch
    is then converted unit by unit and the culprits dead-lettered, a PoisonInputError as it was raised).

    Optional hooks, called when a sink has them: ``stored(batch)`` once the store took a batch, before its
    offsets are committed; ``assigned(partitions)`` and ``revoked(partitions)`` when the group's assignment
    changes (after the buffered batch was stored and committed, on a revoke). The spans sink feeds the
    transitions consumer with them (``fulmen.consumers.transitions.feed``).
    """

    name: str
    topic: TopicKey
    table: str

    def decode(self, record: ConsumerRecord) -> Any: ...

    def to_batch(self, units: Sequence[Any]) -> pa.Table | EncodedRows: ...


@dataclass
class BatchStats(WorkerStats):
    batches: int = 0
    rows: int = 0
    last_batch_at: float = 0.0


class BatchConsumer:
    """Runs one :class:`Sink` over a started consumer (subscribed with this object as rebalance listener)."""

    def __init__(
        self,
        sink: Sink,
        consumer: AIOKafkaConsumer,
        store: Store,
        dead_letters: DeadLetters,
        *,
        max_records: int = 5000,
        max_bytes: int = 4 * 1024**2,
        max_wait_s: float = 0.5,
        retry_backoff_s: float = 0.5,
    ) -> None:
        if max_records < 1 or max_bytes < 1 or max_wait_s <= 0:
            raise ValueError("max_records and max_bytes must be >= 1 and max_wait_s > 0")
        self.sink = sink
        self.consumer = consumer
        self.store = store
        self.dead_letters = dead_letters
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.max_wait_s = max_wait_s
        self.retry_backoff_s = retry_backoff_s
        self.stats = BatchStats()
        self._units: list[Any] = []
        self._records: list[ConsumerRecord] = []
        self._offsets: dict[TopicPartition, int] = {}
        self._bytes = 0  # record values buffered
        self._record_bytes = 0.0  # running mean size of a record value
        self._first_at: float | None = None
        self._lock = asyncio.Lock()
        self._inflight: asyncio.Task[None] | None = None

    def listener(self) -> ConsumerRebalanceListener:
        """Pass this to ``consumer.subscribe``: it flushes the batch before partitions are taken away."""
        return RebalanceListener(self, self.sink.name)

    async def revoked(self, partitions: list[TopicPartition]) -> None:
        """Partitions taken away: insert and commit everything buffered (the revoked partitions with the rest)."""
        await self.flush()
        if (hook := getattr(self.sink, "revoked", None)) is not None:
            hook(partitions)

    def assigned(self, partitions: list[TopicPartition]) -> None:
        """Partitions given: nothing to reset (a revoke flushed the buffer, so it holds none of theirs)."""
        if (hook := getattr(self.sink, "assigned", None)) is not None:
            hook(partitions)

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set; flush what is buffered before returning."""
        while not stop.is_set():
            await self.poll_once()
        await self.flush()

    async def poll_once(self) -> None:
        """One poll, then a flush if the batch is full or old enough."""
        timeout_s = self.max_wait_s
        if self._first_at is not None:
            timeout_s = max(0.0, self._first_at + self.max_wait_s - time.monotonic())
        # what fits in max_bytes at the mean record size seen so far (one record until there is a mean)
        room = self.max_records - len(self._units)
        room = min(room, int((self.max_bytes - self._bytes) / self._record_bytes) if self._record_bytes else 1)
        fetched = await self.consumer.getmany(timeout_ms=int(timeout_s * 1000), max_records=max(1, room))
        for tp, records in fetched.items():
            for record in records:
                await self._take(tp, record)
        full = len(self._units) >= self.max_records or self._bytes >= self.max_bytes
        due = self._first_at is not None and time.monotonic() - self._first_at >= self.max_wait_s
        if full or due or (self._offsets and not self._units):
            await self.flush(wait=False)

    async def _take(self, tp: TopicPartition, record: ConsumerRecord) -> None:
        try:
            unit = self.sink.decode(record)
        except PoisonInputError as exc:
            exc.topic, exc.partition, exc.offset = record.topic, record.partition, record.offset
            await self.dead_letters.send(record, exc)
            self.stats.dead_lettered += 1
        else:
            self._units.append(unit)
            self._records.append(record)
            size = len(record.value or b"")
            self._bytes += size
            self._record_bytes = size if not self._record_bytes else 0.9 * self._record_bytes + 0.1 * size
            if self._first_at is None:
                self._first_at = time.monotonic()
        self._offsets[tp] = record.offset + 1

    async def flush(self, wait: bool = True) -> None:
        """Hand the buffered batch to the store; its offsets are committed once its insert is done.

        One batch is in flight at a time: its insert (in a worker thread) overlaps polling and converting
        the next batch, and a batch's commit never overtakes the one before. ``wait`` returns only when
        everything buffered so far is inserted and committed.
        """
        async with self._lock:
            if self._offsets:
                units, records, offsets = self._units, self._records, self._offsets
                self._units, self._records, self._offsets, self._first_at = [], [], {}, None
                self._bytes = 0
                batch = await self._to_batch(units, records) if units else None
                await self._drain()
                self._inflight = asyncio.create_task(self._insert_and_commit(batch, records, offsets))
            if wait:
                await self._drain()

    async def _drain(self) -> None:
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            await inflight

    async def _insert_and_commit(
        self, batch: pa.Table | EncodedRows | None, records: list[ConsumerRecord], offsets: dict[TopicPartition, int]
    ) -> None:
        started = time.perf_counter()
        rows = await self._insert(batch) if batch is not None else 0
        if batch is not None and (stored := getattr(self.sink, "stored", None)) is not None:
            stored(batch)
        observe_batch(self.sink.name, len(records), started)
        await self.dead_letters.flush()
        await self._commit(offsets)
        self.stats.batches += 1
        self.stats.records += len(records)
        self.stats.rows += rows
        self.stats.last_batch_at = time.time()
        log.info(
            "%s: batch of %d records (%d rows) into %s committed %s",
            self.sink.name,
            len(records),
            rows,
            self.sink.table,
            describe_offsets(offsets),
        )

    async def _insert(self, batch: pa.Table | EncodedRows) -> int:
        return await retrying(  # no stop event: retried until the store takes it, never skipped
            lambda: asyncio.to_thread(self.store.insert_batch, self.sink.table, batch),
            what=f"{self.sink.name}: insert",
            retry_on=(RetryableError,),
            base_s=self.retry_backoff_s,
            logger=log,
        )

    async def _to_batch(self, units: list[Any], records: list[ConsumerRecord]) -> pa.Table | EncodedRows:
        try:
            return self.sink.to_batch(units)
        except (PoisonInputError, pa.ArrowException, OverflowError, ValueError, TypeError) as batch_error:
            log.warning("%s: batch conversion failed (%s); converting record by record", self.sink.name, batch_error)
        good = []
        for unit, record in zip(units, records, strict=True):
            try:
                self.sink.to_batch([unit])
            except (PoisonInputError, pa.ArrowException, OverflowError, ValueError, TypeError) as exc:
                error = (
                    exc
                    if isinstance(exc, PoisonInputError)
                    else PoisonInputError(f"cannot store in {self.sink.table}: {exc}")
                )
                error.topic, error.partition, error.offset = record.topic, record.partition, record.offset
                await self.dead_letters.send(record, error)
                self.stats.dead_lettered += 1
            else:
                good.append(unit)
        return self.sink.to_batch(good)

    async def _commit(self, offsets: dict[TopicPartition, int]) -> None:
        # Only partitions still ours: a revoked partition's records go to its new owner (and dedup there).
        committed = await commit_offsets(self.consumer, offsets, what=self.sink.name, logger=log)
        self.stats.committed.update(committed)
