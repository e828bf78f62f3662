"""What the runners know about every rollout: its latest attempt and that attempt's state.

Built by reading the whole rollouts topic (lifecycle events keyed by rollout id), like a table over a
changelog. Before a runner decides what to do with a request it catches up to the topic's end as of that
moment, so a claim published by another runner just before it crashed is never missed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition

from fulmen.schemas.codec import decode
from fulmen.schemas.errors import ConfigurationError, DecodeError
from fulmen.schemas.events import RolloutEvent, RolloutStatus

__all__ = ["AttemptState", "RolloutLedger"]

log = logging.getLogger(__name__)


@dataclass
class AttemptState:
    attempt: int
    status: RolloutStatus
    runner_id: str


class RolloutLedger:
    """Latest attempt per rollout, from a started consumer with no group (it reads every partition)."""

    def __init__(self, consumer: AIOKafkaConsumer, topic: str) -> None:
        self.consumer = consumer
        self.topic = topic
        self.rollouts: dict[str, AttemptState] = {}
        self._partitions: list[TopicPartition] = []

    async def start(self, partitions: int) -> None:
        """Read the topic (of ``partitions`` partitions) from its beginning up to its current end."""
        if partitions < 1:
            raise ConfigurationError(f"topic {self.topic} does not exist: create the topics (`fulmen kafka up`)")
        self._partitions = [TopicPartition(self.topic, p) for p in range(partitions)]
        self.consumer.assign(self._partitions)
        await self.consumer.seek_to_beginning(*self._partitions)
        await self.catch_up()

    async def catch_up(self) -> None:
        """Read until every partition reaches the end offset it had when this call began."""
        ends = await self.consumer.end_offsets(self._partitions)
        while await self._behind(ends):
            for records in (await self.consumer.getmany(timeout_ms=200, max_records=5000)).values():
                for record in records:
                    self._apply(record.value)

    async def _behind(self, ends: dict[TopicPartition, int]) -> bool:
        for tp, end in ends.items():
            if await self.consumer.position(tp) < end:
                return True
        return False

    def _apply(self, value: bytes | None) -> None:
        try:
            event = decode(RolloutEvent, value)
        except DecodeError:
            return  # the consumers dead-letter it; for the ledger it says nothing
        self.observe(event)

    def observe(self, event: RolloutEvent) -> None:
        """Fold one lifecycle event in (also used for the runner's own events, before they echo back)."""
        current = self.rollouts.get(event.rollout_id)
        if current is None or event.attempt > current.attempt:
            self.rollouts[event.rollout_id] = AttemptState(event.attempt, event.status, event.runner_id)
        elif event.attempt == current.attempt and event.status.rank >= current.status.rank:
            current.status = event.status
            current.runner_id = event.runner_id or current.runner_id

    def get(self, rollout_id: str) -> AttemptState | None:
        return self.rollouts.get(rollout_id)
