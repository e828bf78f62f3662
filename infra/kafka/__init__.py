"""Kafka: the faststream broker and aiokafka clients built from settings, topic administration, the local broker,
publishing, dead letters. Which parts run on faststream and which on aiokafka, and why: :mod:`.broker`."""

from fulmen.infra.kafka.admin import TopicState, cluster_info, describe_topics, ensure_topics
from fulmen.infra.kafka.broker import kafka_broker
from fulmen.infra.kafka.clients import admin_client, consumer, producer, start_or_raise
from fulmen.infra.kafka.dlq import DeadLetters
from fulmen.infra.kafka.local import BrokerStatus, LocalKafka
from fulmen.infra.kafka.publish import EventPublisher, Sender

__all__ = [
    "BrokerStatus",
    "DeadLetters",
    "EventPublisher",
    "LocalKafka",
    "Sender",
    "TopicState",
    "admin_client",
    "cluster_info",
    "consumer",
    "describe_topics",
    "ensure_topics",
    "kafka_broker",
    "producer",
    "start_or_raise",
]
