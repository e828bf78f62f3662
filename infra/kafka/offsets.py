"""The Kafka offset layer every consumer loop uses: what may be committed, committing it, rebalances.

A loop that finishes records out of order (rollouts run concurrently, groups are trained on when complete,
builds wait out a late window) tracks them in an :class:`OffsetTracker`: per partition, the committable offset
is one past the longest prefix of finished records, i.e. the lowest unfinished offset. So a commit never passes
a record whose work is not done (at-least-once: a crash or a rebalance redelivers it).

Lifecycle, per consumer::

    tracker.read(tp, offset)                  # as records are fetched, in offset order
    tracker.done(tp, offset)                  # when a record's effect is durable, in any order
    await commit_finished(consumer, tracker)  # commit_offsets() of tracker.committable(), then tracker.committed()

:func:`commit_offsets` sends only the offsets of partitions still assigned and turns the errors of a rebalance
(``CommitFailedError``, ``IllegalStateError``, rebalance in progress, illegal generation, unknown member) into a
warning and an empty result: the partitions' new owner reads from the last committed offset, and the loop goes
on. Any other ``KafkaError`` is raised as :class:`~fulmen.schemas.errors.RetryableError`.

:class:`RebalanceListener` hands a rebalance to the loop that owns the offsets (a :class:`PartitionOwner`): on
revoke it commits what is finished of the revoked partitions and forgets them; on assign it resets their
tracking. :func:`retrying` retries an awaitable with :func:`backoff_s` between attempts until it succeeds or a
stop event is set.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from typing import Any, Protocol, TypeVar

from aiokafka import ConsumerRebalanceListener
from aiokafka.errors import (
    CommitFailedError,
    IllegalGenerationError,
    IllegalStateError,
    KafkaError,
    RebalanceInProgressError,
    UnknownMemberIdError,
)
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from fulmen.schemas.errors import RetryableError

__all__ = [
    "REBALANCE_ERRORS",
    "Committer",
    "FinishedOffsets",
    "OffsetTracker",
    "PartitionOwner",
    "RebalanceListener",
    "commit_finished",
    "commit_offsets",
    "describe_offsets",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

REBALANCE_ERRORS: tuple[type[KafkaError], ...] = (
    CommitFailedError,  # aiokafka's answer when the group rebalanced under the commit
    IllegalStateError,  # a partition no longer assigned (or no assignment at all)
    RebalanceInProgressError,
    IllegalGenerationError,
    UnknownMemberIdError,
)
"""Commit errors that mean "the group moved on": the commit is dropped, never retried, never fatal."""


# --- lowest unfinished offset per partition ---------------------------------------------------------------------
class _Partition:
    __slots__ = ("committed", "entries", "finished_to")

    def __init__(self) -> None:
        self.entries: OrderedDict[int, float | None] = OrderedDict()  # offset -> ready_at (None: unfinished)
        self.finished_to: int | None = None  # one past the finished prefix already popped from ``entries``
        self.committed: int | None = None  # the last offset a commit sent successfully


class OffsetTracker:
    """Per partition: the offsets read, which are finished, and the offset that may be committed.

    :meth:`read` records in offset order as they are fetched; :meth:`done` marks one finished in any order,
    optionally only from ``ready_at`` (a clock reading compared with the ``now`` given to :meth:`committable`:
    a finished record held back, e.g. for a late window). :meth:`committable` answers, per partition, one past
    the longest prefix of finished records where that moved past the last :meth:`committed` offset; call
    :meth:`committed` with what a commit actually sent (a failed commit is then offered again). A partition that
    is revoked is :meth:`forget`-ten: an offset of it that finishes later is ignored.
    """

    def __init__(self) -> None:
        self._partitions: dict[TopicPartition, _Partition] = {}

    def read(self, tp: TopicPartition, offset: int) -> None:
        """Track ``offset`` as read and not finished (a second read of a tracked or finished offset is ignored)."""
        part = self._partitions.setdefault(tp, _Partition())
        if offset in part.entries or (part.finished_to is not None and offset < part.finished_to):
            return
        last = next(reversed(part.entries), None)
        part.entries[offset] = None
        if last is not None and offset < last:  # read out of order (a seek back): keep the entries sorted
            part.entries = OrderedDict(sorted(part.entries.items()))

    def done(self, tp: TopicPartition, offset: int, *, ready_at: float = -math.inf) -> bool:
        """Mark ``offset`` finished, committable from ``ready_at`` on (a second call moves ``ready_at``).

        Returns whether the offset is tracked; an offset that is not (its partition was forgotten, or it was
        never read) is ignored.
        """
        part = self._partitions.get(tp)
        if part is None or offset not in part.entries:
            return False
        part.entries[offset] = ready_at
        return True

    def committable(
        self, now: float = math.inf, partitions: Collection[TopicPartition] | None = None
    ) -> dict[TopicPartition, int]:
        """Per partition (of ``partitions``, or all tracked): one past the longest prefix of records finished by
        ``now``, where it is past the last committed offset. Records of that prefix stop being tracked."""
        offsets = {}
        for tp, part in self._partitions.items():
            if partitions is not None and tp not in partitions:
                continue
            while part.entries:
                offset, ready_at = next(iter(part.entries.items()))
                if ready_at is None or ready_at > now:
                    break
                part.entries.popitem(last=False)
                part.finished_to = offset + 1
            if part.finished_to is not None and (part.committed is None or part.finished_to > part.committed):
                offsets[tp] = part.finished_to
        return offsets

    def committed(self, offsets: Mapping[TopicPartition, int]) -> None:
        """These offsets were committed; a partition forgotten meanwhile (revoked during the commit) is skipped."""
        for tp, offset in offsets.items():
            part = self._partitions.get(tp)
            if part is not None and (part.committed is None or offset > part.committed):
                part.committed = offset

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        """Drop what is known of ``partitions`` (revoked: their next owner reads them from the committed offset)."""
        for tp in partitions:
            self._partitions.pop(tp, None)

    def partitions(self) -> set[TopicPartition]:
        return set(self._partitions)

    def pending(self, tp: TopicPartition | None = None) -> int:
        """Offsets read (of ``tp``, or of all partitions) that :meth:`committable` has not passed yet."""
        return sum(len(part.entries) for part in self._selected(tp))

    def unfinished(self, tp: TopicPartition | None = None) -> int:
        """Offsets read (of ``tp``, or of all partitions) and not marked done."""
        return sum(1 for part in self._selected(tp) for ready_at in part.entries.values() if ready_at is None)

    def _selected(self, tp: TopicPartition | None) -> list[_Partition]:
        if tp is None:
            return list(self._partitions.values())
        return [self._partitions[tp]] if tp in self._partitions else []


# --- committing -------------------------------------------------------------------------------------------------
class Committer(Protocol):
    """What committing needs of a consumer (aiokafka's ``AIOKafkaConsumer`` has it)."""

    def assignment(self) -> set[TopicPartition]: ...

    async def commit(self, offsets: Any = None) -> None: ...


class FinishedOffsets(Protocol):
    """What :func:`commit_finished` needs of a tracker (:class:`OffsetTracker`, or a class built on one)."""

    def committable(
        self, now: float = math.inf, partitions: Collection[TopicPartition] | None = None
    ) -> dict[TopicPartition, int]: ...

    def committed(self, offsets: Mapping[TopicPartition, int]) -> None: ...


def describe_offsets(offsets: Mapping[TopicPartition, int]) -> str:
    """``topic[partition]=offset, ...`` in partition order, for log lines."""
    return ", ".join(f"{tp.topic}[{tp.partition}]={offset}" for tp, offset in sorted(offsets.items()))


async def commit_offsets(
    consumer: Committer, offsets: Mapping[TopicPartition, int], *, what: str, logger: logging.Logger = log
) -> dict[TopicPartition, int]:
    """Commit ``offsets`` (the next offset to read, per partition) of the partitions still assigned.

    Returns what was committed: empty when nothing was left to commit or the group rebalanced under the commit
    (:data:`REBALANCE_ERRORS`, logged as a warning: the partitions' new owner reads from the last committed
    offset). Raises :class:`RetryableError` for any other ``KafkaError`` (the broker did not take the commit).
    ``what`` names the loop in log lines and errors.
    """
    owned = consumer.assignment()
    mine = {tp: offset for tp, offset in offsets.items() if tp in owned}
    gone = {tp: offset for tp, offset in offsets.items() if tp not in owned}
    if gone:
        logger.debug("%s: not committing %s: no longer assigned", what, describe_offsets(gone))
    if not mine:
        return {}
    try:
        await consumer.commit({tp: OffsetAndMetadata(offset, "") for tp, offset in mine.items()})
    except REBALANCE_ERRORS as exc:
        logger.warning(
            "%s: commit of %s refused after a rebalance; the new owner reads from the last committed offset: %s",
            what,
            describe_offsets(mine),
            exc,
        )
        return {}
    except KafkaError as exc:
        raise RetryableError(f"{what}: committing {describe_offsets(mine)} failed: {exc}") from exc
    return mine


async def commit_finished(
    consumer: Committer,
    tracker: FinishedOffsets,
    *,
    what: str,
    partitions: Collection[TopicPartition] | None = None,
    now: float = math.inf,
    logger: logging.Logger = log,
) -> dict[TopicPartition, int]:
    """Commit what ``tracker`` says is finished (of ``partitions``, or all) and tell it what went out.

    Returns the committed offsets (empty when none advanced or the commit was refused: see :func:`commit_offsets`).
    """
    offsets = tracker.committable(now, partitions)
    if not offsets:
        return {}
    committed = await commit_offsets(consumer, offsets, what=what, logger=logger)
    tracker.committed(committed)
    if committed:
        logger.debug("%s: committed %s", what, describe_offsets(committed))
    return committed


# --- rebalances -------------------------------------------------------------------------------------------------
class PartitionOwner(Protocol):
    """A loop that tracks its own offsets, as :class:`RebalanceListener` sees it."""

    async def revoked(self, partitions: list[TopicPartition]) -> None:
        """Partitions are taken away: commit what is finished of them, then forget them."""
        ...

    def assigned(self, partitions: list[TopicPartition]) -> None:
        """Partitions are given (they are read from their committed offset): track them afresh."""
        ...


class RebalanceListener(ConsumerRebalanceListener):
    """Pass to ``consumer.subscribe(..., listener=...)``: hands each rebalance to the loop owning the offsets.

    aiokafka runs these callbacks inside the consumer's poll (``getmany``), so the owner never meets them halfway
    through its own work on the same task; an exception they raise is logged by aiokafka and the rebalance goes
    on (the owner's uncommitted records are then read again by their next owner).
    """

    def __init__(self, owner: PartitionOwner, name: str) -> None:
        self.owner = owner
        self.name = name

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        partitions = sorted(revoked)
        if partitions:
            log.info("%s: partitions revoked: %s", self.name, _describe_partitions(partitions))
            await self.owner.revoked(partitions)

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        partitions = sorted(assigned)
        log.debug("%s: partitions assigned: %s", self.name, _describe_partitions(partitions))
        self.owner.assigned(partitions)


def _describe_partitions(partitions: list[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions) or "none"
