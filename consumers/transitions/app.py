"""The transitions consumer as one entry of ``fulmen consume``: builds its worker and the clients it owns.

It has its own consumer group over the rollouts topic (``<group_prefix>.transition_builder``), reads the spans
group's committed offsets for its barrier (``<group_prefix>.spans`` unless ``FULMEN_TRANSITIONS_SPANS_GROUP``
says otherwise; Fulmen's group names take ``FULMEN_KAFKA_TOPIC_PREFIX``, see ``fulmen.schemas.topics.group_name``),
and publishes through a broker of its own whose request limit fits the transitions topic's ``max.message.bytes``
(a batch of long episodes is larger than the default 1 MiB). With a :class:`SpanFeed` (when the spans sink runs
in the same process, unless ``FULMEN_TRANSITIONS_FROM_STREAM=false``) it builds finished rollouts from the spans
that sink stored, reading the store only for what the feed cannot vouch for (``fulmen.consumers.transitions.feed``).
"""

from __future__ import annotations

from fulmen.consumers.barrier import OffsetBarrier
from fulmen.consumers.tracked import WorkerContext
from fulmen.consumers.transitions.feed import SpanFeed
from fulmen.consumers.transitions.settings import TransitionsSection
from fulmen.consumers.transitions.worker import TransitionWorker
from fulmen.infra.kafka.broker import kafka_broker
from fulmen.infra.kafka.publish import EventPublisher, Sender
from fulmen.schemas.ddl import TABLES
from fulmen.schemas.topics import TopicKey, topic, topic_name

__all__ = ["SENDER", "TransitionBuilderSink"]

SENDER = Sender("consumers.transitions", (TopicKey.TRANSITIONS,))


class TransitionBuilderSink:
    """Not a row sink: :meth:`worker` makes the :class:`TransitionWorker` that ``ConsumersApp`` runs."""

    name = "transition_builder"
    topic = TopicKey.ROLLOUTS
    table = TABLES["transitions"]

    def __init__(self, section: TransitionsSection | None = None, feed: SpanFeed | None = None) -> None:
        self.section = section or TransitionsSection()
        self.feed = feed  # what this process's spans sink stores, when it runs here (fulmen.consumers.app)

    def worker(self, context: WorkerContext) -> TransitionWorker:
        settings, prefix = context.settings, context.settings.kafka.topic_prefix
        spans_group = self.section.spans_group or f"{context.group_prefix}.spans"
        barrier = OffsetBarrier(settings, topic_name(TopicKey.SPANS, prefix), spans_group)
        limit = int(topic(TopicKey.TRANSITIONS).config.get("max.message.bytes", 1024 * 1024))
        publisher = EventPublisher(kafka_broker(settings, max_request_size=limit), SENDER)
        return TransitionWorker(
            self,
            settings,
            context.consumer,
            context.store,
            context.dead_letters,
            publisher,
            barrier,
            self.section,
            feed=self.feed,
        )
