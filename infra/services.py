"""Start what is missing: the local Kafka (in local mode: one node or a cluster) and the topics; the store and its
tables."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from fulmen.infra.kafka.admin import TopicState, cluster_info, ensure_topics
from fulmen.infra.kafka.cluster import LocalCluster
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store

__all__ = ["KafkaReady", "check_kafka_can_start", "ensure_kafka", "ensure_store"]

log = logging.getLogger(__name__)


@dataclass
class KafkaReady:
    bootstrap: str
    started: LocalCluster | None  # the local Kafka this call started (stop it when done); None if it ran or is remote
    topics: list[TopicState]


def check_kafka_can_start(settings: FulmenSettings) -> None:
    """In local mode, ConfigurationError now if a local Kafka node that does not run could not start (a taken
    port), so a command with a long preparation before :func:`ensure_kafka` fails before it, not after."""
    if settings.local_kafka:
        LocalCluster.from_settings(settings).check_ports()


def ensure_kafka(settings: FulmenSettings, *, start: bool = True) -> KafkaReady:
    """In local mode start the local Kafka's nodes that do not run (``FULMEN_BROKER_NODES`` of them); then create
    or update the topics.

    With ``FULMEN_KAFKA_BOOTSTRAP`` nothing is started: the cluster must answer (BrokerUnavailableError if
    not). With ``start=False`` a local Kafka that does not answer is an error too (a cluster with a node down
    that answers is used as it is).
    """
    started = None
    if settings.local_kafka:
        local = LocalCluster.from_settings(settings)
        status = local.status()
        if not status.running:
            if not start:
                asyncio.run(cluster_info(settings))  # raises BrokerUnavailableError with the hint
            else:
                local.start()
                started = None if status.any_running else local
    else:
        asyncio.run(cluster_info(settings))
    topics = asyncio.run(ensure_topics(settings))
    return KafkaReady(settings.bootstrap, started, topics)


def ensure_store(settings: FulmenSettings) -> Store:
    """Open the store and apply pending migrations."""
    store = Store.open(settings)
    store.migrate()
    return store
