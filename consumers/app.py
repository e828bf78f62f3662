"""The consumers process (``fulmen consume``): one consumer per sink, one store, one dead-letter producer.

The JSON event sinks (:mod:`fulmen.consumers.event_sinks`) are faststream batch subscribers on one broker; the
spans sink runs on a :class:`~fulmen.consumers.batch.BatchConsumer`, the transition builder, the feedback consumer
and the production episode detector on their own workers (aiokafka loops that track their own offsets: see
:mod:`fulmen.infra.kafka.broker`). In local mode this process owns the embedded store. Each sink has its own
consumer group (``<group_prefix>.<sink name>``), so sinks progress independently and scale by partitions: run more
``fulmen consume`` processes against a ClickHouse server and Kafka spreads the partitions over them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from fulmen.consumers.batch import BatchConsumer, Sink
from fulmen.consumers.dead_letters import DeadLetterSink
from fulmen.consumers.event_sinks import EVENT_SINKS, EventSink, SinkHandler, subscribe
from fulmen.consumers.feedback import FeedbackSection, FeedbackSink
from fulmen.consumers.metrics import unwatch, watch
from fulmen.consumers.production import ProductionEpisodesSink, ProductionSection
from fulmen.consumers.settings import ConsumersSettings
from fulmen.consumers.spans import SpanSink
from fulmen.consumers.tracked import Worker, WorkerContext
from fulmen.consumers.transitions import TransitionBuilderSink, TransitionsSection
from fulmen.consumers.transitions.feed import SpanFeed
from fulmen.infra.kafka.broker import kafka_broker
from fulmen.infra.kafka.clients import close_quietly, consumer, consumer_group, producer, start_or_raise
from fulmen.infra.kafka.dlq import DeadLetters
from fulmen.infra.metrics import MetricsListener
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import ReadEndpoint, Store
from fulmen.schemas.topics import TopicKey, topic_name

__all__ = ["ConsumerOptions", "ConsumersApp", "WorkerSink", "consume_sinks", "default_sinks"]

log = logging.getLogger(__name__)


def default_sinks(feed: SpanFeed | None = None) -> list[Sink]:
    """Every sink: spans (feeding ``feed``, if given), the JSON event topics, then the dead-letter topic."""
    return [SpanSink(feed=feed), *EVENT_SINKS.values(), DeadLetterSink()]


@runtime_checkable
class WorkerSink(Protocol):
    """An entry that brings its own worker instead of a :class:`BatchConsumer` (the transition builder, the feedback
    consumer, the production episode detector): a :class:`~fulmen.consumers.tracked.Worker`, made from what the
    app offers (:class:`~fulmen.consumers.tracked.WorkerContext`)."""

    name: str
    topic: TopicKey

    def worker(self, context: WorkerContext) -> Worker: ...


def consume_sinks(settings: FulmenSettings) -> list[Sink | WorkerSink]:
    """What ``fulmen consume`` runs: every table sink, the transitions consumer (``transition_builder``, fed by the
    spans sink unless ``FULMEN_TRANSITIONS_FROM_STREAM=false``), the feedback consumer (``feedback``) and, unless
    ``FULMEN_PRODUCTION_ENABLED=false``, the production episode detector (``production``)."""
    if isinstance(settings, ConsumersSettings):
        transitions, feedback, production = settings.transitions, settings.feedback, settings.production
    else:
        transitions, feedback, production = TransitionsSection(), FeedbackSection(), ProductionSection()
    feed = SpanFeed(transitions.feed_max_mb * 1024**2) if transitions.from_stream else None
    sinks: list[Sink | WorkerSink] = [
        *default_sinks(feed),
        TransitionBuilderSink(transitions, feed),
        FeedbackSink(feedback),
    ]
    if production.enabled:
        sinks.append(ProductionEpisodesSink(production))
    return sinks


@dataclass(frozen=True)
class ConsumerOptions:
    group_prefix: str = "fulmen.consumers"
    serve_reads: bool = True
    max_records: int = 5000
    max_bytes: int = 16 * 1024**2  # record values a batch of the BatchConsumer sinks holds (spans: ~14,000)
    max_wait_s: float = 0.5


class ConsumersApp:
    """Owns the clients of every sink; :meth:`run` until the stop event is set, then closes them cleanly."""

    def __init__(
        self,
        settings: FulmenSettings,
        store: Store,
        sinks: Sequence[Sink | WorkerSink],
        options: ConsumerOptions | None = None,
    ) -> None:
        if not sinks:
            raise ValueError("at least one sink is needed")
        self.settings = settings
        self.store = store
        self.sinks = list(sinks)
        self.options = options or ConsumerOptions()
        self.workers: list[Worker | SinkHandler] = []  # a BatchConsumer, what a WorkerSink makes, or a SinkHandler
        self.read_endpoint: ReadEndpoint | None = None

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        prefix = self.settings.kafka.topic_prefix
        watch(self)  # the workers' counts and lags in /metrics (fulmen.consumers.metrics)
        reads = self._read_endpoint()
        metrics = None if reads is not None else MetricsListener.from_settings(self.settings.metrics, what="consumers")
        if metrics is not None:
            await metrics.start()
        if reads is not None:
            await reads.start()
        dlq_producer = producer(self.settings)
        clients: list = [dlq_producer]
        # The JSON sinks' subscribers: consumers only (their dead letters go through the shared producer); a
        # handler still running at stop gets a few seconds, then is cancelled before its commit (read again).
        broker = kafka_broker(self.settings, consumer_only=True, graceful_timeout=5.0)
        try:
            await start_or_raise(dlq_producer, self.settings, "dead-letter producer")
            loops = []
            for sink in self.sinks:
                group = f"{self.options.group_prefix}.{sink.name}"
                dead_letters = DeadLetters(dlq_producer, prefix=prefix, consumer_group=group)
                if isinstance(sink, EventSink):
                    self.workers.append(self._subscribe(broker, sink, group, dead_letters))
                    continue
                kafka_consumer = consumer(self.settings, group)
                clients.insert(0, kafka_consumer)
                worker: Worker
                if isinstance(sink, WorkerSink):
                    context = WorkerContext(
                        self.settings, kafka_consumer, self.store, dead_letters, self.options.group_prefix
                    )
                    worker = sink.worker(context)
                else:
                    worker = BatchConsumer(
                        sink,
                        kafka_consumer,
                        self.store,
                        dead_letters,
                        max_records=self.options.max_records,
                        max_bytes=self.options.max_bytes,
                        max_wait_s=self.options.max_wait_s,
                    )
                # Start before subscribing: start() then only connects (bounded by the connect timeout),
                # and the group join, which may wait out a crashed member's session, happens while polling.
                await start_or_raise(kafka_consumer, self.settings, f"consumer {group}")
                kafka_consumer.subscribe([topic_name(sink.topic, prefix)], listener=worker.listener())
                self.workers.append(worker)
                loops.append(worker)
            if broker.subscribers:
                clients.insert(0, broker)  # stopped first: its handlers commit through their own consumers
                await start_or_raise(broker, self.settings, "consumers (event sinks)")
            log.info("consumers running: %s", ", ".join(s.name for s in self.sinks))
            if ready is not None:
                ready.set()
            await asyncio.gather(stop.wait(), *(worker.run(stop) for worker in loops))
        finally:
            unwatch(self)
            await close_quietly(clients)
            if reads is not None:
                await reads.stop()
            if metrics is not None:
                await metrics.stop()

    def _subscribe(self, broker: Any, sink: EventSink, group: str, dead_letters: DeadLetters) -> SinkHandler:
        """Declare ``sink``'s faststream subscriber on ``broker``, handled by a new :class:`SinkHandler`."""
        handler = SinkHandler(sink, self.store, dead_letters)
        subscriber = subscribe(
            broker,
            sink,
            consumer_group(self.settings, group),
            max_records=self.options.max_records,
            max_wait_s=self.options.max_wait_s,
        )
        subscriber(handler.handler())
        return handler

    def _read_endpoint(self) -> ReadEndpoint | None:
        """In embedded mode this process owns the store, so it serves reads to the others."""
        settings = self.settings.clickhouse
        if not self.store.embedded or not self.options.serve_reads or settings.read_port == 0:
            return None
        token = settings.read_token.get_secret_value() if settings.read_token else None
        self.read_endpoint = ReadEndpoint(self.store, settings.read_host, settings.read_port, token=token)
        return self.read_endpoint
