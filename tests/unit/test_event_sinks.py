"""The JSON sinks' faststream handler and its acknowledgement policy, against in-memory fakes (the real broker and
store: tests/integration/test_consumers.py); the broker's settings, declared once."""

from __future__ import annotations

import asyncio
from itertools import chain

import pytest
from aiokafka.structs import TopicPartition
from faststream.exceptions import IncorrectState
from faststream.middlewares import AckPolicy
from faststream.security import SASLScram512

from fulmen.consumers.event_sinks import EVENT_SINKS, SinkHandler, subscribe
from fulmen.infra.kafka.broker import kafka_broker
from fulmen.infra.kafka.dlq import DeadLetters
from fulmen.infra.kafka.publish import EventPublisher, Sender
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas import DeadLetterHeaders, RolloutEvent, RolloutStatus, TopicKey, encode
from tests.fakes import FakeBroker, FakeConsumer, FakeProducer, FakeStore

TOPIC = "fulmen.rollouts"


def _event(i: int) -> bytes:
    return encode(RolloutEvent(rollout_id=f"r{i}", attempt=1, status=RolloutStatus.RUNNING, task_id="t", group_id="g"))


def _build() -> tuple[SinkHandler, FakeConsumer, FakeProducer, FakeStore]:
    consumer = FakeConsumer()
    producer = FakeProducer(consumer.events)
    store = FakeStore(consumer.events)
    handler = SinkHandler(
        EVENT_SINKS["rollouts"],
        store,
        DeadLetters(producer, consumer_group="g"),  # type: ignore[arg-type]
        retry_backoff_s=0.001,
    )
    return handler, consumer, producer, store


async def _poll(consumer: FakeConsumer) -> list:
    return list(chain(*(await consumer.getmany(timeout_ms=1)).values()))


async def test_a_batch_is_committed_after_its_insert_and_a_poison_record_is_dead_lettered_alone() -> None:
    handler, consumer, producer, store = _build()
    for value in (_event(0), _event(1), b"not json", _event(2)):
        consumer.append(TOPIC, 0, value)
    consumer.append(TOPIC, 1, _event(3))
    await handler.handle(await _poll(consumer), consumer)
    assert sorted(r["RolloutId"] for r in store.rows("rollouts")) == ["r0", "r1", "r2", "r3"]
    assert [m["value"] for m in producer.sent] == [b"not json"]
    headers = DeadLetterHeaders.from_kafka(producer.sent[0]["headers"])
    assert (headers.source_topic, headers.source_partition, headers.source_offset) == (TOPIC, 0, 2)
    assert consumer.events == ["dlq-send", "insert", "commit"]  # dead letter and rows, then the offsets
    assert consumer.committed == {TopicPartition(TOPIC, 0): 4, TopicPartition(TOPIC, 1): 1}
    assert (handler.stats.records, handler.stats.rows, handler.stats.dead_lettered) == (4, 4, 1)


async def test_a_failed_batch_is_rewound_uncommitted_and_read_again() -> None:
    handler, consumer, _, store = _build()
    for i in range(3):
        consumer.append(TOPIC, 0, _event(i))
    insert = store.insert_batch

    def broken_once(table, data):  # type: ignore[no-untyped-def]
        store.insert_batch = insert  # type: ignore[method-assign]
        raise RuntimeError("not a retryable error: a bug, say")

    store.insert_batch = broken_once  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        await handler.handle(await _poll(consumer), consumer)
    assert consumer.committed == {} and consumer.position[TopicPartition(TOPIC, 0)] == 0  # rewound
    await handler.handle(await _poll(consumer), consumer)  # faststream's next poll: the same records
    assert [r["RolloutId"] for r in store.rows("rollouts")] == ["r0", "r1", "r2"]
    assert consumer.committed == {TopicPartition(TOPIC, 0): 3}


async def test_a_store_outage_is_retried_within_the_batch_never_skipped() -> None:
    handler, consumer, _, store = _build()
    store.failures = 2
    consumer.append(TOPIC, 0, _event(0))
    await asyncio.wait_for(handler.handle(await _poll(consumer), consumer), 10)
    assert consumer.events == ["insert-failed", "insert-failed", "insert", "commit"]


def test_the_broker_carries_the_prefix_and_the_subscribers_an_explicit_policy() -> None:
    settings = FulmenSettings(kafka={"topic_prefix": "p."})
    broker = kafka_broker(settings)
    publisher = EventPublisher(broker, Sender("runner", (TopicKey.ROLLOUTS,)))
    assert publisher.topic_name(TopicKey.ROLLOUTS) == "p.fulmen.rollouts"
    subscriber = subscribe(broker, EVENT_SINKS["rollouts"], "p.fulmen.consumers.rollouts")
    assert [t.name for t in subscriber.topics] == [
        "p.fulmen.rollouts"
    ] and subscriber.group_id == "p.fulmen.consumers.rollouts"
    assert subscriber.ack_policy is AckPolicy.MANUAL  # never faststream's ACK_FIRST (auto-commit) default
    options = subscriber._connection_args  # what the subscriber's aiokafka consumer is built with
    assert (options["enable_auto_commit"], options["auto_offset_reset"], options["isolation_level"]) == (
        False,
        "earliest",
        "read_committed",
    )
    assert not subscriber.topics_to_create  # topics come from ensure_topics, with their settings


def test_sasl_and_ssl_settings_map_onto_the_broker() -> None:
    settings = FulmenSettings(
        kafka={
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_username": "u",
            "sasl_password": "pw",
        }
    )
    security = kafka_broker(settings).specification.security
    assert isinstance(security, SASLScram512) and (security.username, security.password) == ("u", "pw")
    assert not security.use_ssl


def test_a_publisher_refuses_what_its_sender_did_not_declare() -> None:
    broker = FakeBroker(FakeProducer([]))
    publisher = EventPublisher(broker, Sender("submit", (TopicKey.TASKS,)))  # type: ignore[arg-type]
    assert [d["title"] for d in broker.declared] == ["submit:send:tasks"]
    with pytest.raises(ValueError, match="submit publishes to tasks, not to rollouts"):
        publisher.topic_name(TopicKey.ROLLOUTS)
    with pytest.raises(ValueError, match="spans carry no JSON event"):
        Sender("gateway", (TopicKey.SPANS,))


async def test_a_published_event_is_one_keyed_json_record_on_the_prefixed_topic() -> None:
    producer = FakeProducer([])
    publisher = EventPublisher(FakeBroker(producer, prefix="p."), Sender("runner", (TopicKey.ROLLOUTS,)))  # type: ignore[arg-type]
    event = RolloutEvent(rollout_id="r1", attempt=1, status=RolloutStatus.RUNNING, task_id="t1", group_id="g1")
    await publisher.publish(TopicKey.ROLLOUTS, event)
    assert producer.sent == [
        {
            "topic": "p.fulmen.rollouts",
            "value": encode(event),
            "key": b"r1",
            "headers": [("content-type", b"application/json")],
        }
    ]


async def test_publishing_before_the_broker_started_is_refused() -> None:
    publisher = EventPublisher(kafka_broker(FulmenSettings()), Sender("runner", (TopicKey.ROLLOUTS,)))
    event = RolloutEvent(rollout_id="r1", attempt=1, status=RolloutStatus.RUNNING, task_id="t1", group_id="g1")
    with pytest.raises(IncorrectState, match="connect broker first"):
        await publisher.publish(TopicKey.ROLLOUTS, event)
