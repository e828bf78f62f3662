"""The collector: consumes ``fulmen.transitions`` with its own consumer group and hands out closed groups.

Lifecycle: build with a started consumer over the transitions topic (or any object with aiokafka's
``getmany``/``commit``, e.g. an in-memory fake) and a :class:`~fulmen.algorithm.groups.GroupBook`; register each
dispatched group (:meth:`Collector.expect`); call :meth:`Collector.poll` repeatedly: it decodes the records
that arrived, files them (the book's rules: latest attempt, completion, timeout policy) and returns the groups
that closed, kept or dropped. Once the caller has made a group's effect durable (trained on it and published
the model version, or reported its validation result) it calls :meth:`Collector.done`, then
:meth:`Collector.commit`.

Offsets (at-least-once): a record is "held" while its group is open or closed-but-not-done; the committed
offset of a partition is its lowest held offset, or one past the last record read when none is held. So a
crash redelivers every record whose group was not yet trained on. A redelivered record whose group this
process does not know (dispatched before a restart) is ignored and counted, as is an undecodable record
(logged with its topic, partition and offset).

Superseded attempts: a retried attempt's batch is normally never published (the transitions worker skips an
attempt whose next attempt the rollouts topic already announced: see ``fulmen.consumers.transitions.worker``). Should
one arrive anyway, the book keeps only the latest attempt of each rollout, replacing a provisional failed
attempt when its retry arrives and ignoring older ones (``older_attempts``), so a superseded attempt never
reaches a training batch.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Protocol

from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, TopicPartition

from fulmen.algorithm.dispatcher import DispatchedGroup
from fulmen.algorithm.groups import AddOutcome, ClosedGroup, GroupBook
from fulmen.schemas.codec import decode
from fulmen.schemas.errors import DecodeError
from fulmen.schemas.events import TransitionBatch

__all__ = ["Collector", "OffsetLedger", "TransitionSource"]

log = logging.getLogger(__name__)


class TransitionSource(Protocol):
    """What the collector needs of a consumer (aiokafka's ``AIOKafkaConsumer`` has it)."""

    async def getmany(
        self, *partitions: TopicPartition, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[TopicPartition, list[ConsumerRecord]]: ...

    async def commit(self, offsets: Any = None) -> None: ...


class OffsetLedger:
    """Per partition: the records read and which of them a group still holds; what may be committed."""

    def __init__(self) -> None:
        self._next: dict[TopicPartition, int] = {}
        self._held: dict[TopicPartition, set[int]] = defaultdict(set)
        self._by_group: dict[str, list[tuple[TopicPartition, int]]] = defaultdict(list)
        self._committed: dict[TopicPartition, int] = {}

    def seen(self, tp: TopicPartition, offset: int, group_id: str | None) -> None:
        """Record ``offset`` as read; held by ``group_id`` until :meth:`release` (None: done at once)."""
        self._committed.setdefault(tp, offset)  # where this process started reading: nothing to commit below
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)
        if group_id is not None:
            self._held[tp].add(offset)
            self._by_group[group_id].append((tp, offset))

    def release(self, group_id: str) -> None:
        """The group's records are done with."""
        for tp, offset in self._by_group.pop(group_id, []):
            self._held[tp].discard(offset)

    def committable(self) -> dict[TopicPartition, int]:
        """Per partition, the offset to commit (the next record to read after a restart), where it advanced."""
        offsets = {}
        for tp, next_offset in self._next.items():
            offset = min(self._held[tp], default=next_offset)
            if offset > self._committed[tp]:
                offsets[tp] = offset
        return offsets

    def committed(self, offsets: dict[TopicPartition, int]) -> None:
        self._committed.update(offsets)


class Collector:
    """Transition batches -> closed groups; see the module docstring for the lifecycle and offsets."""

    def __init__(
        self, source: TransitionSource, book: GroupBook, *, poll_timeout_ms: int = 500, max_records: int = 500
    ) -> None:
        self.source = source
        self.book = book
        self.poll_timeout_ms = poll_timeout_ms
        self.max_records = max_records
        self.ledger = OffsetLedger()
        self.undecodable = 0
        self.older_attempts = 0

    @property
    def ignored(self) -> int:
        """Batches of groups not in flight here."""
        return self.book.ignored

    def expect(self, groups: Iterable[DispatchedGroup]) -> None:
        for group in groups:
            self.book.expect(group)

    async def poll(self) -> list[ClosedGroup]:
        """Read what arrived (waiting up to ``poll_timeout_ms``) and return the groups that closed: completed
        ones, then timed-out ones (kept or dropped). Dropped groups are done at once."""
        batches = await self.source.getmany(timeout_ms=self.poll_timeout_ms, max_records=self.max_records)
        closed: list[ClosedGroup] = []
        for tp, records in batches.items():
            for record in records:
                group = self._file(tp, record)
                if group is not None:
                    closed.append(group)
        closed.extend(self.book.expire())
        for group in closed:
            if not group.kept:
                self.ledger.release(group.group_id)
        return closed

    def done(self, group_ids: Iterable[str]) -> None:
        """The effects of these groups are durable: their records may be committed."""
        for group_id in group_ids:
            self.ledger.release(group_id)

    async def commit(self) -> dict[TopicPartition, int]:
        """Commit what :class:`OffsetLedger` allows; returns the committed offsets (empty when none advanced)."""
        offsets = self.ledger.committable()
        if offsets:
            await self.source.commit({tp: OffsetAndMetadata(offset, "") for tp, offset in offsets.items()})
            self.ledger.committed(offsets)
            log.debug(
                "committed transitions offsets %s", {f"{tp.topic}[{tp.partition}]": o for tp, o in offsets.items()}
            )
        return offsets

    def _file(self, tp: TopicPartition, record: ConsumerRecord) -> ClosedGroup | None:
        try:
            batch = decode(TransitionBatch, record.value, topic=tp.topic, partition=tp.partition, offset=record.offset)
        except DecodeError as exc:
            self.undecodable += 1
            log.error("skipping an undecodable transition batch: %s", exc)
            self.ledger.seen(tp, record.offset, None)
            return None
        outcome, group = self.book.add(batch)
        if outcome is AddOutcome.OLDER_ATTEMPT:
            self.older_attempts += 1
        self.ledger.seen(tp, record.offset, None if outcome is AddOutcome.UNKNOWN_GROUP else batch.group_id)
        return group
