"""The offset barrier: wait until the spans consumer has stored every span produced before a moment.

Lifecycle: when rollout events are consumed, :meth:`OffsetBarrier.snapshot` takes the spans topic's end offsets
(per partition). Every span published before those events sits below those offsets: the runner flushes an
agent's spans, and the OTLP gateway answers only once Kafka acknowledged them, before the terminal event is
published. :meth:`OffsetBarrier.wait` then polls the offsets the spans consumer *group* has committed until
each partition's commit reaches the snapshot. The spans consumer commits a batch only after inserting it, so
from then on the store holds every one of those spans. Committed offsets are group-wide, so the barrier holds
however many ``fulmen consume`` processes share the spans partitions.

Bounded wait: after ``warn_after_s`` the wait logs a WARNING naming the partitions that lag and by how much,
and keeps waiting (again every ``warn_after_s``). It never gives up and builds from what is stored: a partial
set of spans would be trained on as if it were the whole episode. While the spans consumer is down the
transitions stall visibly, and resume by themselves when it catches up. Setting ``stop`` ends the wait
(returns False) without building.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from infra.kafka.clients import admin_client, close_quietly, consumer, start_or_raise
from infra.settings import FulmenSettings

__all__ = ["OffsetBarrier", "Snapshot"]

log = logging.getLogger(__name__)

Snapshot = dict[TopicPartition, int]
"""End offset per partition of the spans topic at one moment."""

_METADATA_MAX_AGE_S = 60.0  # re-read the spans topic's partitions this often (partitions may be added)


class OffsetBarrier:
    """Start with :meth:`start`, close with :meth:`stop`. One instance per transitions worker."""

    def __init__(
        self,
        settings: FulmenSettings,
        spans_topic: str,
        spans_group: str,
        *,
        warn_after_s: float = 30.0,
        max_poll_s: float = 0.25,
    ) -> None:
        if warn_after_s <= 0 or max_poll_s <= 0:
            raise ValueError("warn_after_s and max_poll_s must be > 0")
        self.settings = settings
        self.spans_topic = spans_topic
        self.spans_group = spans_group
        self.warn_after_s = warn_after_s
        self.max_poll_s = max_poll_s
        self._offsets = consumer(settings, None)  # no group: only asks for end offsets
        self._admin = admin_client(settings)
        self._coordinator: int | None = None
        self._partitions: list[TopicPartition] = []
        self._partitions_at = 0.0

    async def start(self) -> None:
        await start_or_raise(self._offsets, self.settings, "transitions: spans offsets reader")
        await start_or_raise(self._admin, self.settings, "transitions: spans group offsets reader")

    async def stop(self) -> None:
        await close_quietly([self._offsets, self._admin])

    async def snapshot(self) -> Snapshot:
        """The spans topic's end offsets now."""
        partitions = await self._spans_partitions()
        return dict(await self._offsets.end_offsets(partitions))

    async def committed(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        """The spans group's committed offset per partition (0 where it has committed nothing)."""
        if self._coordinator is None:
            self._coordinator = await self._admin.find_coordinator(self.spans_group)
        try:
            found = await self._admin.list_consumer_group_offsets(self.spans_group, self._coordinator, partitions)
        except KafkaError:
            self._coordinator = None  # the coordinator may have moved: look it up again next time
            raise
        return {tp: max(0, found[tp].offset) if tp in found else 0 for tp in partitions}

    async def lag(self, snapshot: Snapshot) -> dict[TopicPartition, int]:
        """How many records each partition's commit is short of the snapshot (only lagging partitions)."""
        committed = await self.committed(list(snapshot))
        return {tp: end - committed[tp] for tp, end in snapshot.items() if committed[tp] < end}

    async def wait(self, snapshot: Snapshot, stop: asyncio.Event) -> bool:
        """Wait until the spans group has committed up to ``snapshot``; False when ``stop`` was set first."""
        started = warned = time.monotonic()
        pause = 0.01
        while not stop.is_set():
            try:
                lagging = await self.lag(snapshot)
            except KafkaError as exc:
                log.warning("transitions: reading the offsets of %s failed, retrying: %s", self.spans_group, exc)
                lagging = {}
                pause = self.max_poll_s
            else:
                if not lagging:
                    return True
            now = time.monotonic()
            if lagging and now - warned >= self.warn_after_s:
                warned = now
                log.warning(
                    "transitions: waited %.0fs for the spans consumer (group %s) to store the spans of finished "
                    "rollouts; behind on %s; transitions wait until it catches up",
                    now - started, self.spans_group, _describe(lagging),
                )  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), pause)
            pause = min(self.max_poll_s, pause * 1.5)
        return False

    async def _spans_partitions(self) -> list[TopicPartition]:
        if not self._partitions or time.monotonic() - self._partitions_at > _METADATA_MAX_AGE_S:
            described = await self._admin.describe_topics([self.spans_topic])
            numbers = [p["partition"] for p in described[0]["partitions"]] if described[0]["error_code"] == 0 else []
            if not numbers and not self._partitions:
                raise KafkaError(f"topic {self.spans_topic} does not exist (run `fulmen kafka topics --create`)")
            if numbers:
                self._partitions = [TopicPartition(self.spans_topic, p) for p in sorted(numbers)]
                self._partitions_at = time.monotonic()
        return self._partitions


def _describe(lagging: dict[TopicPartition, int]) -> str:
    return ", ".join(f"{tp.topic}[{tp.partition}] by {gap}" for tp, gap in sorted(lagging.items()))
