"""Start what is missing: the local broker (in local mode) and the topics; the store and its tables."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from fulmen.infra.kafka.admin import TopicState, cluster_info, ensure_topics
from fulmen.infra.kafka.local import LocalKafka
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store

__all__ = ["KafkaReady", "ensure_kafka", "ensure_store"]

log = logging.getLogger(__name__)


@dataclass
class KafkaReady:
    bootstrap: str
    started: LocalKafka | None  # the broker this call started (stop it when done), None if it was running or remote
    topics: list[TopicState]


def ensure_kafka(settings: FulmenSettings, *, start: bool = True) -> KafkaReady:
    """In local mode start the broker unless it runs; then create or update the topics.

    With ``FULMEN_KAFKA_BOOTSTRAP`` nothing is started: the cluster must answer (BrokerUnavailableError if
    not). With ``start=False`` a local broker that is not running is an error too.
    """
    started = None
    if settings.local_kafka:
        broker = LocalKafka.from_settings(settings)
        if not broker.status().running:
            if not start:
                asyncio.run(cluster_info(settings))  # raises BrokerUnavailableError with the hint
            broker.start()
            started = broker
    else:
        asyncio.run(cluster_info(settings))
    topics = asyncio.run(ensure_topics(settings))
    return KafkaReady(settings.bootstrap, started, topics)


def ensure_store(settings: FulmenSettings) -> Store:
    """Open the store and apply pending migrations."""
    store = Store.open(settings)
    store.migrate()
    return store
