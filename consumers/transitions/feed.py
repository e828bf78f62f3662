"""The span feed: the transitions consumer builds a finished rollout from the spans it saw go by, not from the store.

When the spans consumer runs in the same process (``fulmen consume`` runs both), the spans sink hands the feed the
narrow record of every span a rollout stamped (the native flattener's ``flatten_records``) while the transitions
worker has rollouts claimed and not built yet (when it has none, no record is made: stored spans then cost nothing
more, and their rollout attempts are only named), after the batch is in the store and before its offsets are
committed. The feed holds them by rollout
attempt until the transitions worker takes them at the rollout's end; the store is read only when the feed cannot
vouch for a rollout.

**When the feed has every span of a rollout** (:class:`~fulmen.consumers.transitions.worker.TransitionWorker`
checks this, the feed gives the facts):

1. *Coverage*: an epoch begins each time the spans consumer's assignment changes; the feed holds spans only while
   that consumer owns every partition of the spans topic (one ``fulmen consume`` process, or one that took them
   all). Every span record at or past the position it resumed from is fed, in order.
2. *A mark*: once an epoch covers every partition, the worker reads the rollouts topic's end offsets. A rollout
   whose ``claimed`` event sits at or past the mark was claimed after coverage began; the runner publishes that
   event, acknowledged, before the agent runs, so every span of the attempt was appended after the spans
   consumer's resume position and was fed.
3. *The barrier*: the rollout's end waits, as before, until the spans group has committed past the spans topic's
   end offsets read after the end (:mod:`fulmen.consumers.barrier`). Within an epoch only this process commits
   that group, and it feeds before it commits: every span of the rollout is here.
4. *Nothing dropped*: a span flattened while no rollout was wanted is not held, and its rollout attempt is
   remembered as dropped (its claim was read after that span, or it was built already: a late span); the feed
   holds at most ``max_bytes`` (token ids and logprobs at four bytes each, plus an
   allowance a span), and past it the rollouts that began first are dropped too. A dropped rollout's build reads
   the store. Past ``max_evicted`` remembered rollouts (or ``max_evicted`` wanted ones) the epoch ends: everything
   held is dropped.

A rollout that fails any of these (claimed before the mark, production episodes, which nothing stamps, a restart
or rebalance) is read from the store exactly as before: the crash rules do not change, since nothing here is
committed or kept across a restart.

*Late spans*: a rollout built while an epoch covers (from the feed or the store) is released at its build; a span
of it that arrives later is held again (or remembered as dropped), and that is how the worker learns it is late,
without asking the store, as long as the epoch lasts.
"""

from __future__ import annotations

import logging
import sys
from array import array
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from aiokafka.structs import TopicPartition

from fulmen.consumers.transitions.reader import EXTRA_ATTRIBUTES, RolloutKey, span_record
from fulmen.consumers.transitions.tree import SpanRecord
from fulmen.schemas import semconv

__all__ = ["RECORD_ATTRIBUTES", "RECORD_EVENT_ATTRIBUTES", "SpanFeed", "feed_span_record"]

log = logging.getLogger(__name__)

RECORD_ATTRIBUTES = EXTRA_ATTRIBUTES
"""The span attributes the native flattener copies into a record (``record_attributes``), in this order."""
RECORD_EVENT_ATTRIBUTES = (*semconv.REWARD_KEYS, semconv.GEN_AI_RESPONSE_ID)
"""The event attributes it copies (``record_event_attributes``): the two reward keys, then the response id."""

_SPAN_ALLOWANCE = 1400  # bytes a held span costs besides its token ids and logprobs (measured: 1.2 KB a record)


class SpanFeed:
    """Stamped spans by rollout attempt, fed by the spans sink and taken by the transitions worker (one event loop:
    no locking)."""

    def __init__(self, max_bytes: int = 64 * 1024**2, max_evicted: int = 100_000) -> None:
        if max_bytes < 1 or max_evicted < 1:
            raise ValueError("max_bytes and max_evicted must be >= 1")
        self.max_bytes = max_bytes
        self.max_evicted = max_evicted
        self.epoch = 0
        self.evictions = 0  # rollouts dropped for room, since the start
        self._owned: set[TopicPartition] = set()
        self._expected: frozenset[TopicPartition] = frozenset()
        self._held: dict[RolloutKey, dict[tuple[str, str], tuple[Any, ...]]] = {}  # in order of first span
        self._sizes: dict[RolloutKey, int] = {}
        self._bytes = 0
        self._evicted: dict[RolloutKey, None] = {}  # an ordered set: the rollouts with spans not held
        self.wanted: set[str] = set()  # the rollout ids claimed and not built yet: records are made while any

    # --- the spans consumer's side ----------------------------------------------------------------------------
    def assigned(self, partitions: Collection[TopicPartition]) -> None:
        self._owned.update(partitions)
        self._new_epoch()

    def revoked(self, partitions: Collection[TopicPartition]) -> None:
        self._owned.difference_update(partitions)
        self._new_epoch()

    def add(self, records: Iterable[Sequence[Any]], skipped: Iterable[RolloutKey] = ()) -> None:
        """Hold the records of a batch the store took (``Flattener.flatten_records``' tuples); ``skipped``: the
        rollout attempts it had spans of that were not wanted then (not held: their builds read the store)."""
        if not self.covering:
            return
        for rollout, attempt in skipped:
            self._drop((rollout, int(attempt)))
        for record in records:
            key = (record[0], int(record[1]))
            if key in self._evicted:
                continue  # its build reads the store: it has spans this feed dropped
            spans = self._held.get(key)
            if spans is None:
                spans = self._held[key] = {}
                self._sizes[key] = 0
            size = _SPAN_ALLOWANCE + len(record[10]) + len(record[11]) + len(record[12])
            old = spans.get((record[2], record[3]))
            if old is not None:
                size -= _SPAN_ALLOWANCE + len(old[10]) + len(old[11]) + len(old[12])  # delivered again
            spans[(record[2], record[3])] = record
            self._sizes[key] += size
            self._bytes += size
        if self._bytes > self.max_bytes:
            self._evict()

    # --- the transitions worker's side ------------------------------------------------------------------------
    def expect(self, partitions: Collection[TopicPartition]) -> None:
        """Every partition of the spans topic (the worker reads them for its barrier): the feed holds spans only
        while the spans consumer owns them all."""
        expected = frozenset(partitions)
        if expected != self._expected:
            self._expected = expected
            self._new_epoch()

    @property
    def covering(self) -> bool:
        return bool(self._expected) and self._expected <= self._owned

    def want(self, rollout_id: str) -> None:
        """The worker saw ``rollout_id`` claimed: hold its spans from now on."""
        self.wanted.add(rollout_id)
        if len(self.wanted) > self.max_evicted:
            log.warning("span feed: over %d running rollouts wanted; starting over", self.max_evicted)
            self._new_epoch()

    def take(self, key: RolloutKey) -> list[SpanRecord] | None:
        """The spans held for ``key``, released (``[]``: none arrived); None when some were dropped for room."""
        self.wanted.discard(key[0])
        if key in self._evicted:
            del self._evicted[key]
            self._release(key)
            return None
        return [feed_span_record(record) for record in self._release(key).values()]

    def discard(self, key: RolloutKey) -> None:
        """Drop what is held for ``key`` (built from the store, superseded, dead-lettered)."""
        self.wanted.discard(key[0])
        self._release(key)
        self._evicted.pop(key, None)

    def arrived(self, key: RolloutKey) -> bool:
        """Whether a span of ``key`` arrived since it was taken or discarded (in this epoch)."""
        return key in self._held or key in self._evicted

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._held)

    def _release(self, key: RolloutKey) -> dict[tuple[str, str], tuple[Any, ...]]:
        spans = self._held.pop(key, {})
        self._bytes -= self._sizes.pop(key, 0)
        return spans

    def _evict(self) -> None:
        """Drop the rollouts that began first until a quarter of the room is free again."""
        evicted = 0
        while self._held and self._bytes > self.max_bytes * 3 // 4:
            self._drop(next(iter(self._held)))
            evicted += 1
        self.evictions += evicted
        log.info("span feed: %d rollout(s) dropped for room (their builds read the store)", evicted)

    def _drop(self, key: RolloutKey) -> None:
        """Hold nothing of ``key`` from now on, and remember that (its build reads the store)."""
        self._release(key)
        self._evicted[key] = None
        if len(self._evicted) > self.max_evicted:
            log.warning("span feed: over %d dropped rollouts remembered; starting over", self.max_evicted)
            self._new_epoch()

    def _new_epoch(self) -> None:
        self.epoch += 1
        self._held.clear()
        self._sizes.clear()
        self._evicted.clear()
        self.wanted.clear()
        self._bytes = 0


def feed_span_record(record: Sequence[Any]) -> SpanRecord:
    """A :class:`SpanRecord` from one of the native flattener's records (``native/otlp_rows/src/records.rs``)."""
    prompt, response, logprobs = array("I"), array("I"), array("f")
    for values, data in ((prompt, record[10]), (response, record[11]), (logprobs, record[12])):
        values.frombytes(data)
        if sys.byteorder == "big":
            values.byteswap()  # the records hold little-endian values
    rewards_a, rewards_b, response_ids = record[16]
    return span_record(
        record[2:10],
        prompt,
        response,
        logprobs,
        record[13],
        attributes=record[14],
        events=(record[15], rewards_a, rewards_b, response_ids),
        links=(record[17], record[18]),
    )
