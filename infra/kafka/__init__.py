"""Kafka: clients built from settings, topic administration, the local broker, publishing, dead letters."""

from fulmen.infra.kafka.admin import TopicState, cluster_info, describe_topics, ensure_topics
from fulmen.infra.kafka.clients import admin_client, consumer, producer, start_or_raise
from fulmen.infra.kafka.dlq import DeadLetters
from fulmen.infra.kafka.local import BrokerStatus, LocalKafka
from fulmen.infra.kafka.publish import EventPublisher

__all__ = [
    "BrokerStatus",
    "DeadLetters",
    "EventPublisher",
    "LocalKafka",
    "TopicState",
    "admin_client",
    "cluster_info",
    "consumer",
    "describe_topics",
    "ensure_topics",
    "producer",
    "start_or_raise",
]
