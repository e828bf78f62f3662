"""The production episode detector: spans-topic records → open episodes per trace → a rollout end when one goes idle.

Lifecycle of a poll (up to ``max_batch`` records):

1. scan each record (``scan``): the traces it holds production calls of (LLM calls with token ids, no rollout id)
   open or extend their episode (``episodes``); a record keyed by an open trace restarts that trace's idle time;
2. a record that holds no call of an open episode is done at once; one that does waits for those episodes' ends;
3. each episode idle for ``FULMEN_PRODUCTION_IDLE_S`` ends: its :class:`RolloutEvent` (rollout ``trace-<trace id>``,
   attempt 1, mode ``production``, no group, ``succeeded``, no reward) is published to the rollouts topic,
   acknowledged, and only then are its records done;
4. commit, per partition, up to the lowest record not done.

From there the rest is what a dispatched rollout gets: the rollouts consumer stores the rollout, and the transitions
consumer builds its transitions from the trace's spans that no rollout stamped, after its offset barrier (the spans
were on the spans topic before the end was published, so the barrier covers them), watching for late spans as
usual. The group of this consumer is ``<group_prefix>.production``; it reads the spans topic beside the spans
consumer, whose group it never touches.

Nothing is lost on a crash: a record holding calls of an episode that has not ended is not committed, so a restart
(or the partition's next owner after a rebalance) reads it again and the episode opens again; its idle time starts
again from that read. An episode whose end was published but whose records were not yet committed may end a second
time: the same rollout id, built again from the same spans (the transitions table keeps one row per call, readers
of the topic keep the newest batch). Store or broker failures are retried with backoff until they succeed or
``stop`` is set. All of it runs in one task, so a rebalance (which runs inside the poll) never meets a half-done end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition

from fulmen.consumers.production.episodes import Episode, OpenEpisodes
from fulmen.consumers.production.scan import scan_record
from fulmen.consumers.production.settings import ProductionSection
from fulmen.consumers.tracked import Fetched, TrackedWorker, WorkerStats
from fulmen.infra.kafka.clients import close_quietly, start_or_raise
from fulmen.infra.kafka.offsets import OffsetTracker
from fulmen.infra.kafka.publish import EventPublisher
from fulmen.infra.retry import STOPPED
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas.errors import RetryableError
from fulmen.schemas.events import RolloutEvent, RolloutMode, RolloutStatus, production_rollout_id
from fulmen.schemas.topics import TopicKey

__all__ = ["ProductionStats", "ProductionWorker", "production_end"]

log = logging.getLogger(__name__)

RUNNER_ID = "fulmen consume: production"
"""The ``runner_id`` of a production rollout's end (no runner ran it)."""


def production_end(trace_id: str) -> RolloutEvent:
    """The end of the production episode of ``trace_id``: succeeded, attempt 1, no group, no reward (feedback and
    the trace's reward spans give it one)."""
    rollout_id = production_rollout_id(trace_id)
    return RolloutEvent(
        rollout_id=rollout_id,
        attempt=1,
        status=RolloutStatus.SUCCEEDED,
        task_id=rollout_id,
        group_id="",
        mode=RolloutMode.PRODUCTION,
        runner_id=RUNNER_ID,
    )


@dataclass
class ProductionStats(WorkerStats):
    calls: int = 0  # production calls read (a call read again after a restart counts again)
    ended: int = 0  # episodes whose end was published


class ProductionWorker(TrackedWorker):
    """Runs over a started consumer subscribed to the spans topic (with :meth:`listener`)."""

    name = "production"
    retry_on = (RetryableError, KafkaError)

    def __init__(
        self,
        sink: Any,
        settings: FulmenSettings,
        consumer: AIOKafkaConsumer,
        publisher: EventPublisher,
        section: ProductionSection,
        *,
        retry_backoff_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            sink,
            consumer,
            OffsetTracker(),
            ProductionStats(),
            max_batch=section.max_batch,
            retry_backoff_s=retry_backoff_s,
            clock=clock,
            logger=log,
        )
        self.settings = settings
        self.publisher = publisher
        self.section = section
        self.episodes = OpenEpisodes(section.idle_s, clock)

    async def start(self) -> None:
        await start_or_raise(self.publisher.broker, self.settings, "production episodes publisher")

    async def close(self) -> None:
        await close_quietly([self.publisher.broker])

    def full(self) -> bool:
        return len(self.episodes) >= self.section.max_open

    def poll_ms(self) -> int:
        """Up to 200 ms, less when an episode ends sooner."""
        ends_at = self.episodes.next_end()
        if ends_at is None:
            return 200
        return int(min(200.0, max(10.0, (ends_at - self.clock()) * 1000)))

    async def take(self, fetched: Fetched, stop: asyncio.Event) -> None:
        for tp, records in fetched.items():
            for record in records:
                self._read(tp, record)

    async def work(self, stop: asyncio.Event) -> None:
        """End the episodes gone idle."""
        idle = self.episodes.idle()
        if idle:
            await self._end(idle, stop)

    def _read(self, tp: TopicPartition, record: ConsumerRecord) -> None:
        found = scan_record(record.key, record.value)
        if found.key_trace is not None:
            self.episodes.touch(found.key_trace)
        for trace_id in dict.fromkeys(found.calls):
            self.episodes.call(trace_id, (tp, record.offset))
        self.stats.calls += len(found.calls)
        if not self.episodes.held((tp, record.offset)):
            self.done(tp, record.offset)

    async def _end(self, idle: list[Episode], stop: asyncio.Event) -> None:
        """Publish the ends of ``idle`` (acknowledged), then close them: their records are done."""
        events = [production_end(episode.trace_id) for episode in idle]
        sent = await self.retrying(
            lambda: self.publisher.publish_many(TopicKey.ROLLOUTS, events), "publishing episode ends", stop
        )
        if sent is STOPPED:
            return  # nothing closed: the records stay uncommitted, read again after a restart
        for tp, offset in self.episodes.close(episode.trace_id for episode in idle):
            self.done(tp, offset)
        self.stats.ended += len(idle)
        shown = ", ".join(event.rollout_id for event in events[:3]) + (", ..." if len(events) > 3 else "")
        log.info(
            "production: %d episode(s) idle for %gs ended (%s); %d open",
            len(idle),
            self.section.idle_s,
            shown,
            len(self.episodes),
        )

    def forget(self, partitions: list[TopicPartition]) -> None:
        dropped = self.episodes.forget(partitions)
        if dropped:
            log.debug("production: %d open episode(s) left with their partitions", len(dropped))
