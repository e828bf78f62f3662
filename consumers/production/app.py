"""The production episode detector as one entry of ``fulmen consume``: builds its worker and the publisher it owns.

It has its own consumer group over the spans topic (``<group_prefix>.production``), beside the spans consumer's,
and publishes the ends of production episodes to the rollouts topic through a broker of its own.
``FULMEN_PRODUCTION_ENABLED=false`` leaves it out of ``fulmen consume``.
"""

from __future__ import annotations

from fulmen.consumers.production.settings import ProductionSection
from fulmen.consumers.production.worker import ProductionWorker
from fulmen.consumers.tracked import WorkerContext
from fulmen.infra.kafka.broker import kafka_broker
from fulmen.infra.kafka.publish import EventPublisher, Sender
from fulmen.schemas.topics import TopicKey

__all__ = ["SENDER", "ProductionEpisodesSink"]

SENDER = Sender("consumers.production", (TopicKey.ROLLOUTS,))


class ProductionEpisodesSink:
    """Not a row sink: :meth:`worker` makes the :class:`ProductionWorker` that ``ConsumersApp`` runs."""

    name = "production"
    topic = TopicKey.SPANS

    def __init__(self, section: ProductionSection | None = None) -> None:
        self.section = section or ProductionSection()

    def worker(self, context: WorkerContext) -> ProductionWorker:
        """Neither the store (what the episodes hold is built by the transitions consumer) nor dead letters (a
        record the scan cannot read is the spans consumer's to dead-letter) are its business."""
        publisher = EventPublisher(kafka_broker(context.settings), SENDER)
        return ProductionWorker(self, context.settings, context.consumer, publisher, self.section)
