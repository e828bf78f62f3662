"""Open production episodes: the traces with production calls not ended yet, how long each has been idle, and which
span records hold each (a record's offset may be committed only once every episode it holds has ended).

An episode opens with the first production call of its trace that this consumer reads, and every span of the trace
read after that (a call, or any record keyed by the trace) restarts its idle time; it ends once it has been idle for
``idle_s`` (a session window with an inactivity gap, on the time this consumer read the spans). Ending is two steps:
:meth:`OpenEpisodes.idle` says which are over, the caller publishes their ends, then :meth:`OpenEpisodes.close`
removes them and answers the records no open episode holds any more. A trace that receives a call after its episode
ended opens a new episode of the same trace: it ends again, and the episode is built again with every call.

Pure (no I/O); the clock is a parameter, so the idle rule is tested with a fake one.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from aiokafka.structs import TopicPartition

__all__ = ["Episode", "OpenEpisodes", "RecordKey"]

RecordKey = tuple[TopicPartition, int]
"""A spans-topic record: its partition and offset."""


@dataclass
class Episode:
    """One open episode: its trace, when it opened and was last seen (clock seconds), the records of its calls."""

    trace_id: str
    opened_at: float
    last_seen: float
    records: set[RecordKey] = field(default_factory=set)


class OpenEpisodes:
    """The open episodes, least recently seen first."""

    def __init__(self, idle_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if idle_s <= 0:
            raise ValueError("idle_s must be > 0")
        self.idle_s = idle_s
        self.clock = clock
        self._open: OrderedDict[str, Episode] = OrderedDict()
        self._holders: dict[RecordKey, int] = {}  # record -> open episodes it holds calls of

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, trace_id: object) -> bool:
        return trace_id in self._open

    def call(self, trace_id: str, record: RecordKey) -> None:
        """A production call of ``trace_id`` in ``record``: open its episode or restart its idle time."""
        now = self.clock()
        episode = self._open.pop(trace_id, None) or Episode(trace_id, now, now)
        episode.last_seen = now
        self._open[trace_id] = episode  # to the end: the order stays least recently seen first
        if record not in episode.records:
            episode.records.add(record)
            self._holders[record] = self._holders.get(record, 0) + 1

    def touch(self, trace_id: str) -> bool:
        """Another span of ``trace_id`` arrived: restart the idle time of its episode, if one is open."""
        episode = self._open.get(trace_id)
        if episode is None:
            return False
        episode.last_seen = self.clock()
        self._open.move_to_end(trace_id)
        return True

    def idle(self) -> list[Episode]:
        """The episodes idle for ``idle_s`` or more, longest idle first (still open: :meth:`close` them)."""
        cutoff = self.clock() - self.idle_s
        over = []
        for episode in self._open.values():
            if episode.last_seen > cutoff:
                break
            over.append(episode)
        return over

    def next_end(self) -> float | None:
        """The clock reading at which the next episode ends unless it is seen again (None: none open)."""
        first = next(iter(self._open.values()), None)
        return None if first is None else first.last_seen + self.idle_s

    def held(self, record: RecordKey) -> bool:
        """Whether an open episode has calls in ``record``."""
        return record in self._holders

    def close(self, trace_ids: Iterable[str]) -> list[RecordKey]:
        """Remove these episodes (ended); the records that no open episode holds any more."""
        released = []
        for trace_id in trace_ids:
            episode = self._open.pop(trace_id, None)
            for record in episode.records if episode is not None else ():
                left = self._holders.pop(record) - 1
                if left:
                    self._holders[record] = left
                else:
                    released.append(record)
        return released

    def forget(self, partitions: Collection[TopicPartition]) -> list[str]:
        """Drop what the records of ``partitions`` (revoked: their next owner reads them again) told; the episodes
        left with no record are dropped and returned (their trace ids)."""
        gone = set(partitions)
        dropped = []
        for trace_id, episode in list(self._open.items()):
            revoked = {record for record in episode.records if record[0] in gone}
            if not revoked:
                continue
            episode.records -= revoked
            if not episode.records:
                del self._open[trace_id]
                dropped.append(trace_id)
        for record in [record for record in self._holders if record[0] in gone]:
            del self._holders[record]
        return dropped
