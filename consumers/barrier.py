"""The offset barrier: build a rollout only once the spans consumer has stored every span produced before its end.

Lifecycle: when a poll brings terminal rollout events, :meth:`OffsetBarrier.snapshot` takes the spans topic's end
offsets (per partition). Every span published before those events sits below those offsets: the runner flushes
an agent's spans and the OTLP gateway answers only once Kafka acknowledged them, and the LLM gateway publishes a
call's span (acknowledged) before answering the call, all before the terminal event is published. The events
then wait in :class:`WaitingRounds` until the offsets the spans consumer *group* has committed reach the snapshot
on every partition. The spans consumer commits a batch only after inserting it, so from then on the store holds
every one of those spans. Committed offsets are group-wide, so the barrier holds however many ``fulmen consume``
processes share the spans partitions.

Rounds wait side by side (a new poll does not wait for the previous round's barrier), and are released in order:
snapshots only grow, so a round is never ready before the rounds taken earlier.

Bounded wait: a round that has waited ``warn_after_s`` is reported by a WARNING naming the partitions that lag
and by how much, again every ``warn_after_s``; it keeps waiting. It is never built from what happens to be
stored: a partial set of spans would be trained on as if it were the whole episode. While the spans consumer is
down the transitions stall visibly, and resume by themselves when it catches up.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from fulmen.infra.kafka.clients import admin_client, close_quietly, consumer, consumer_group, start_or_raise
from fulmen.infra.settings import FulmenSettings

__all__ = ["OffsetBarrier", "Round", "Snapshot", "WaitingRounds", "behind"]

log = logging.getLogger(__name__)

Snapshot = dict[TopicPartition, int]
"""End offset per partition of the spans topic at one moment."""

_METADATA_MAX_AGE_S = 60.0  # re-read the spans topic's partitions this often (partitions may be added)


def behind(snapshot: Snapshot, committed: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
    """How many records each partition's commit is short of ``snapshot`` (only the partitions that are)."""
    return {tp: end - committed.get(tp, 0) for tp, end in snapshot.items() if committed.get(tp, 0) < end}


class OffsetBarrier:
    """Reads the spans topic's end offsets and the spans group's commits. :meth:`start` it, :meth:`stop` it."""

    def __init__(
        self, settings: FulmenSettings, spans_topic: str, spans_group: str, *, user: str = "transitions"
    ) -> None:
        """``spans_group`` is the configured name; the group read is the one the spans consumer joined. ``user`` names
        the consumer that waits, in errors (the feedback consumer waits on the rollouts topic's group too)."""
        self.settings = settings
        self.user = user
        self.spans_topic = spans_topic
        self.spans_group = consumer_group(settings, spans_group)
        self._offsets = consumer(settings, None)  # no group: only asks for end offsets
        self._admin = admin_client(settings)
        self._coordinator: int | None = None
        self._partitions: list[TopicPartition] = []
        self._partitions_at = 0.0

    async def start(self) -> None:
        await start_or_raise(self._offsets, self.settings, f"{self.user}: {self.spans_topic} offsets reader")
        await start_or_raise(self._admin, self.settings, f"{self.user}: {self.spans_group} offsets reader")

    async def stop(self) -> None:
        await close_quietly([self._offsets, self._admin])

    async def snapshot(self) -> Snapshot:
        """The spans topic's end offsets now."""
        partitions = await self.spans_partitions()
        return dict(await self._offsets.end_offsets(partitions))

    async def committed(self) -> dict[TopicPartition, int]:
        """The spans group's committed offset per partition (0 where it has committed nothing)."""
        partitions = await self.spans_partitions()
        if self._coordinator is None:
            self._coordinator = await self._admin.find_coordinator(self.spans_group)
        try:
            found = await self._admin.list_consumer_group_offsets(self.spans_group, self._coordinator, partitions)
        except KafkaError:
            self._coordinator = None  # the coordinator may have moved: look it up again next time
            raise
        return {tp: max(0, found[tp].offset) if tp in found else 0 for tp in partitions}

    async def end_offsets(self, topic: str, partitions: set[int]) -> dict[int, int]:
        """Another topic's end offsets now (the transitions consumer's mark on the rollouts topic), by partition."""
        ends = await self._offsets.end_offsets([TopicPartition(topic, p) for p in sorted(partitions)])
        return {tp.partition: end for tp, end in ends.items()}

    async def spans_partitions(self) -> list[TopicPartition]:
        """The spans topic's partitions (described again every minute: partitions may be added)."""
        if not self._partitions or time.monotonic() - self._partitions_at > _METADATA_MAX_AGE_S:
            described = await self._admin.describe_topics([self.spans_topic])
            numbers = [p["partition"] for p in described[0]["partitions"]] if described[0]["error_code"] == 0 else []
            if not numbers and not self._partitions:
                raise KafkaError(f"topic {self.spans_topic} does not exist (run `fulmen kafka topics --create`)")
            if numbers:
                self._partitions = [TopicPartition(self.spans_topic, p) for p in sorted(numbers)]
                self._partitions_at = time.monotonic()
        return self._partitions


@dataclass
class Round:
    """Terminal events of one poll (``items``: (rollouts partition, record, event)) and their snapshot."""

    items: list[Any]
    snapshot: Snapshot
    since: float = field(default_factory=time.monotonic)
    warned: float = 0.0


class WaitingRounds:
    """Rounds waiting for the barrier, oldest first."""

    def __init__(
        self, spans_group: str, warn_after_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if warn_after_s <= 0:
            raise ValueError("warn_after_s must be > 0")
        self.spans_group = spans_group
        self.warn_after_s = warn_after_s
        self.clock = clock
        self._rounds: deque[Round] = deque()

    def __len__(self) -> int:
        return len(self._rounds)

    def add(self, items: list[Any], snapshot: Snapshot) -> None:
        self._rounds.append(Round(items, snapshot, self.clock(), self.clock()))

    def release(self, committed: dict[TopicPartition, int]) -> list[Any]:
        """Pop the rounds whose snapshot the commits reach; their items, oldest first. Warn about a stall."""
        ready: list[Any] = []
        while self._rounds and not behind(self._rounds[0].snapshot, committed):
            ready.extend(self._rounds.popleft().items)
        if self._rounds:
            head, now = self._rounds[0], self.clock()
            if now - head.warned >= self.warn_after_s:
                head.warned = now
                log.warning(
                    "transitions: %d rollout(s) have waited %.0fs for the spans consumer (group %s) to store their "
                    "spans; it is behind on %s; they wait until it catches up",
                    len(head.items),
                    now - head.since,
                    self.spans_group,
                    _describe(behind(head.snapshot, committed)),
                )
        return ready

    def drop(self, keep: Callable[[Any], bool]) -> list[Any]:
        """Remove the items ``keep`` refuses (a revoked partition's); return them."""
        dropped = []
        for waiting in self._rounds:
            dropped.extend(item for item in waiting.items if not keep(item))
            waiting.items = [item for item in waiting.items if keep(item)]
        return dropped


def _describe(lagging: dict[TopicPartition, int]) -> str:
    return ", ".join(f"{tp.topic}[{tp.partition}] by {gap}" for tp, gap in sorted(lagging.items()))
