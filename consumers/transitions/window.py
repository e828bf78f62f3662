"""The transitions consumer's memory: which rollout events are done, which may be committed, what was built.

Commit policy: the offset of a rollout event is committed once the event is handled and, for a terminal event
that was built, once its *late window* has passed too (``late_window_s`` after the build). Until then the
rollout stays in :meth:`BuildWindow.built` and is watched for late spans. The window therefore survives a
crash or a rebalance: the events whose window had not passed are read again from the committed offset and
built again (their batches are published a second time, as at-least-once delivery allows: readers keep the
newest batch of a rollout attempt). Commits go in offset order per partition, whatever order events finish in.

:class:`AttemptTracker` remembers the highest attempt seen per rollout (bounded, least recently seen
forgotten first), so a terminal event of an older attempt that arrives after a newer attempt began is skipped.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime

from aiokafka.structs import ConsumerRecord, TopicPartition

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


@dataclass
class _Entry:
    ready_at: float | None = None  # monotonic time from which the offset may be committed; None: not done
    built: RolloutKey | None = None


class BuildWindow:
    """Per partition, the events read and not yet committed (in offset order), and the built rollouts."""

    def __init__(self) -> None:
        self._pending: dict[TopicPartition, OrderedDict[int, _Entry]] = {}
        self._built: dict[RolloutKey, Built] = {}

    def read(self, tp: TopicPartition, offset: int) -> None:
        """Record that the event at ``offset`` was read (not done yet)."""
        self._pending.setdefault(tp, OrderedDict())[offset] = _Entry()

    def done(self, tp: TopicPartition, offset: int, ready_at: float) -> None:
        """The event is handled; its offset may be committed from ``ready_at`` (monotonic seconds)."""
        self._pending[tp][offset].ready_at = ready_at

    def built(self, item: Built, ready_at: float) -> None:
        """The event's batch was published; watch the rollout for late spans until ``ready_at``."""
        key = (item.event.rollout_id, item.event.attempt)
        entry = self._pending[item.tp][item.record.offset]
        entry.ready_at, entry.built = ready_at, key
        self._built[key] = item

    def has_built(self, key: RolloutKey) -> bool:
        return key in self._built

    def unwatch(self, key: RolloutKey) -> None:
        """Stop watching ``key`` for late spans (its entry stays until committed)."""
        self._built.pop(key, None)

    def watched(self) -> dict[RolloutKey, Built]:
        """The rollouts built and still in their late window."""
        return self._built

    def committable(self, now: float, partitions: list[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """Pop the leading events of each partition (of ``partitions``, or all) that are done and past their
        window; the offsets to commit (last such offset + 1). Their rollouts stop being watched."""
        commits = {}
        for tp, entries in self._pending.items():
            if partitions is not None and tp not in partitions:
                continue
            last = None
            while entries:
                offset, entry = next(iter(entries.items()))
                if entry.ready_at is None or entry.ready_at > now:
                    break
                entries.popitem(last=False)
                if entry.built is not None:
                    self._built.pop(entry.built, None)
                last = offset
            if last is not None:
                commits[tp] = last + 1
        return commits

    def forget(self, partitions: list[TopicPartition]) -> None:
        """Drop what is known of ``partitions`` (revoked: their next owner reads them again)."""
        for tp in partitions:
            for entry in self._pending.pop(tp, {}).values():
                if entry.built is not None:
                    self._built.pop(entry.built, None)

    def pending(self) -> int:
        return sum(len(entries) for entries in self._pending.values())


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
