"""Kafka: clients built from settings, topic administration, the local broker, publishing, dead letters."""

from infra.kafka.admin import TopicState, cluster_info, describe_topics, ensure_topics
from infra.kafka.clients import admin_client, consumer, producer, start_or_raise
from infra.kafka.dlq import DeadLetters
from infra.kafka.local import BrokerStatus, LocalKafka
from infra.kafka.publish import EventPublisher

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
