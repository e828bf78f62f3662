"""The transitions consumer's memory: which rollout events are done, which may be committed, what was built.

Commit policy: the offset of a rollout event is committed once the event is handled and, for a terminal event
that was built, once its *late window* has passed too (``late_window_s`` after the build). Until then the
rollout stays in :meth:`BuildWindow.built` and is watched for late spans. The window therefore survives a
crash or a rebalance: the events whose window had not passed are read again from the committed offset and
built again (their batches are published a second time, as at-least-once delivery allows: readers keep the
newest batch of a rollout attempt). Commits go in offset order per partition, whatever order events finish in
(the lowest unfinished offset: :class:`~fulmen.infra.kafka.offsets.OffsetTracker`).

:class:`AttemptTracker` remembers the highest attempt seen per rollout (bounded, least recently seen
forgotten first), so a terminal event of an older attempt that arrives after a newer attempt began is skipped.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import datetime

from aiokafka.structs import ConsumerRecord, TopicPartition

from fulmen.infra.kafka.offsets import OffsetTracker
from fulmen.schemas.events import RolloutEvent

__all__ = ["AttemptTracker", "BuildWindow", "Built"]

RolloutKey = tuple[str, int]


@dataclass
class Built:
    """A rollout attempt whose batch was published: the event it came from, and what it was built from."""

    event: RolloutEvent
    span_count: int
    created_at: datetime
    tp: TopicPartition
    record: ConsumerRecord
    feed_epoch: int | None = None  # the span feed's epoch at the build, when it covered the spans topic


class BuildWindow:
    """Per partition, the events read and not yet committed (an :class:`OffsetTracker`), and the built rollouts.

    It is a :class:`~fulmen.infra.kafka.offsets.FinishedOffsets`: hand it to
    :func:`~fulmen.infra.kafka.offsets.commit_finished` with the clock as ``now``.
    """

    def __init__(self) -> None:
        self._offsets = OffsetTracker()
        self._built: dict[RolloutKey, Built] = {}
        # Per partition, the built events by offset (a heap): a commit stops watching the rollouts below it by
        # popping them, not by scanning every watched rollout (tens of thousands in a minute's window). An entry
        # whose rollout was unwatched or built again since is skipped when it comes up.
        self._by_offset: dict[TopicPartition, list[tuple[int, RolloutKey]]] = {}

    def read(self, tp: TopicPartition, offset: int) -> None:
        """Record that the event at ``offset`` was read (not done yet)."""
        self._offsets.read(tp, offset)

    def done(self, tp: TopicPartition, offset: int, ready_at: float) -> None:
        """The event is handled; its offset may be committed from ``ready_at`` (monotonic seconds)."""
        self._offsets.done(tp, offset, ready_at=ready_at)

    def built(self, item: Built, ready_at: float) -> None:
        """The event's batch was published; watch the rollout for late spans until ``ready_at``."""
        if self._offsets.done(item.tp, item.record.offset, ready_at=ready_at):  # not when its partition is gone
            key = (item.event.rollout_id, item.event.attempt)
            self._built[key] = item
            heapq.heappush(self._by_offset.setdefault(item.tp, []), (item.record.offset, key))

    def has_built(self, key: RolloutKey) -> bool:
        return key in self._built

    def unwatch(self, key: RolloutKey) -> None:
        """Stop watching ``key`` for late spans (its offset stays tracked until committed)."""
        self._built.pop(key, None)

    def watched(self) -> dict[RolloutKey, Built]:
        """The rollouts built and still in their late window."""
        return self._built

    def committable(
        self, now: float = math.inf, partitions: Collection[TopicPartition] | None = None
    ) -> dict[TopicPartition, int]:
        """The offsets to commit (of ``partitions``, or all): one past the leading events of each partition that
        are done and past their window. The rollouts of those events stop being watched."""
        commits = self._offsets.committable(now, partitions)
        for tp, below in commits.items():
            heap = self._by_offset.get(tp, [])
            while heap and heap[0][0] < below:
                _, key = heapq.heappop(heap)
                item = self._built.get(key)
                if item is not None and item.tp == tp and item.record.offset < below:
                    del self._built[key]
        return commits

    def committed(self, offsets: Mapping[TopicPartition, int]) -> None:
        self._offsets.committed(offsets)

    def forget(self, partitions: list[TopicPartition]) -> None:
        """Drop what is known of ``partitions`` (revoked: their next owner reads them again)."""
        self._offsets.forget(partitions)
        for tp in partitions:
            self._by_offset.pop(tp, None)
        self._unwatch(lambda item: item.tp in partitions)

    def pending(self) -> int:
        return self._offsets.pending()

    def _unwatch(self, which: Callable[[Built], bool]) -> None:
        for key in [key for key, item in self._built.items() if which(item)]:
            del self._built[key]


class AttemptTracker:
    """The highest attempt seen per rollout, for the ``capacity`` rollouts seen last."""

    def __init__(self, capacity: int = 200_000) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._latest: OrderedDict[str, int] = OrderedDict()

    def observe(self, event: RolloutEvent) -> None:
        latest = self._latest.pop(event.rollout_id, 0)
        self._latest[event.rollout_id] = max(latest, event.attempt)
        while len(self._latest) > self.capacity:
            self._latest.popitem(last=False)

    def superseded(self, event: RolloutEvent) -> bool:
        """Whether a later attempt of ``event``'s rollout has been seen."""
        return self._latest.get(event.rollout_id, 0) > event.attempt
