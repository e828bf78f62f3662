"""The collector: consumes ``fulmen.transitions`` with its own consumer group and hands out closed groups.

Lifecycle: build with a started consumer over the transitions topic (or any object with aiokafka's
``getmany``/``commit``, e.g. an in-memory fake) and a :class:`~fulmen.algorithm.service.groups.GroupBook`; register each
dispatched group (:meth:`Collector.expect`); call :meth:`Collector.poll` repeatedly: it decodes the records
that arrived, files them (the book's rules: latest attempt, completion, timeout policy) and returns the groups
that closed, kept or dropped. Once the caller has made a group's effect durable (trained on it and published
the model version, or reported its validation result) it calls :meth:`Collector.done`, then
:meth:`Collector.commit`.

Offsets (at-least-once): a record is "held" while its group is open or closed-but-not-done; the committed
offset of a partition is its lowest held offset, or one past the last record read when none is held (an
:class:`~fulmen.infra.kafka.offsets.OffsetTracker`). So a crash redelivers every record whose group was not yet
trained on. A commit refused because the group rebalanced is logged and dropped (the partitions' new owner
reads from the last committed offset); offsets of partitions no longer assigned are not sent. A redelivered
record whose group this process does not know (dispatched before a restart) is ignored and counted, as is an
undecodable record (logged with its topic, partition and offset).

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

from aiokafka.structs import ConsumerRecord, TopicPartition

from fulmen.algorithm.service.dispatcher import DispatchedGroup
from fulmen.algorithm.service.groups import AddOutcome, ClosedGroup, GroupBook
from fulmen.infra.kafka.offsets import OffsetTracker, commit_finished
from fulmen.schemas.codec import decode
from fulmen.schemas.errors import DecodeError
from fulmen.schemas.events import TransitionBatch

__all__ = ["Collector", "GroupHolds", "TransitionSource"]

log = logging.getLogger(__name__)


class TransitionSource(Protocol):
    """What the collector needs of a consumer (aiokafka's ``AIOKafkaConsumer`` has it)."""

    async def getmany(
        self, *partitions: TopicPartition, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[TopicPartition, list[ConsumerRecord]]: ...

    def assignment(self) -> set[TopicPartition]: ...

    async def commit(self, offsets: Any = None) -> None: ...


class GroupHolds:
    """The records read, in an :class:`OffsetTracker`, and which group holds each until it is released."""

    def __init__(self) -> None:
        self.offsets = OffsetTracker()
        self._by_group: dict[str, list[tuple[TopicPartition, int]]] = defaultdict(list)

    def seen(self, tp: TopicPartition, offset: int, group_id: str | None) -> None:
        """Record ``offset`` as read; held by ``group_id`` until :meth:`release` (None: done at once)."""
        self.offsets.read(tp, offset)
        if group_id is None:
            self.offsets.done(tp, offset)
        else:
            self._by_group[group_id].append((tp, offset))

    def release(self, group_id: str) -> None:
        """The group's records are done with."""
        for tp, offset in self._by_group.pop(group_id, []):
            self.offsets.done(tp, offset)


class Collector:
    """Transition batches -> closed groups; see the module docstring for the lifecycle and offsets."""

    def __init__(
        self, source: TransitionSource, book: GroupBook, *, poll_timeout_ms: int = 500, max_records: int = 500
    ) -> None:
        self.source = source
        self.book = book
        self.poll_timeout_ms = poll_timeout_ms
        self.max_records = max_records
        self.ledger = GroupHolds()
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
        """Commit the offsets below every held record; returns the committed offsets (empty when none advanced,
        or when a rebalance refused the commit: see :func:`~fulmen.infra.kafka.offsets.commit_offsets`)."""
        return await commit_finished(self.source, self.ledger.offsets, what="collector", logger=log)

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
