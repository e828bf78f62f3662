"""``FULMEN_KAFKA_CLIENT=librdkafka``: Fulmen's producers on librdkafka (confluent-kafka), against the real broker.

The producer keeps aiokafka's calls and errors: what a consumer reads back is what was sent (key, value, headers,
the acknowledged offsets), a thread sends and waits without the event loop, no broker is the same clear error,
and a broker gone under it fails a publish in time. The runner's events and spans go through it end to end.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import pytest
from aiokafka.errors import KafkaError

from fulmen.infra.kafka.admin import ensure_topics
from fulmen.infra.kafka.clients import close_quietly, connection_kwargs, producer, start_or_raise
from fulmen.infra.kafka.local import LocalKafka
from fulmen.infra.kafka.publish import EventPublisher
from fulmen.infra.kafka.rdkafka import RdkafkaProducer, rdkafka_config
from fulmen.infra.processes import free_port
from fulmen.infra.settings import BrokerSettings, FulmenSettings
from fulmen.schemas import ModelVersion, TopicKey
from fulmen.schemas.errors import BrokerUnavailableError
from fulmen.schemas.topics import topic_name
from tests.integration.test_feedback import records_of

pytestmark = pytest.mark.integration


def on_librdkafka(settings: FulmenSettings) -> FulmenSettings:
    settings.kafka.client = "librdkafka"
    return settings


async def test_what_it_sends_is_what_a_consumer_reads_with_the_offsets_it_acknowledged(
    settings: FulmenSettings,
) -> None:
    client = producer(on_librdkafka(settings), linger_ms=0)
    assert isinstance(client, RdkafkaProducer)
    name = topic_name(TopicKey.SPANS, settings.kafka.topic_prefix)
    await start_or_raise(client, settings, "test producer")
    try:
        sent = {f"k{i}".encode(): f"value {i}".encode() * (1 + i % 50) for i in range(300)}
        futures = [await client.send(name, value, key, headers=[("h", key)]) for key, value in sent.items()]
        acknowledged = [await future for future in futures]
        from_thread = await asyncio.to_thread(client.send_many_blocking, [(name, b"t", b"from a thread")], 10.0)
    finally:
        await close_quietly([client])
    assert from_thread == 1
    records = await records_of(settings, TopicKey.SPANS, len(sent) + 1)
    assert len(records) == len(sent) + 1
    read = {(r.key, r.value, tuple(r.headers)) for r in records if r.key != b"t"}
    assert read == {(key, value, (("h", key),)) for key, value in sent.items()}  # each once, as sent
    assert Counter((r.partition, r.offset) for r in records if r.key != b"t") == Counter(
        (m.partition, m.offset) for m in acknowledged
    )  # the acknowledged offsets are where the records are
    assert {m.topic for m in acknowledged} == {name}


async def test_a_full_queue_waits_for_room_instead_of_failing(settings: FulmenSettings) -> None:
    config = rdkafka_config(connection_kwargs(settings) | {"linger_ms": 0}) | {"queue.buffering.max.messages": 4}
    client = RdkafkaProducer(config)
    name = topic_name(TopicKey.SPANS, settings.kafka.topic_prefix)
    await start_or_raise(client, settings, "test producer")
    try:
        futures = [await client.send(name, b"v%d" % i, b"k%d" % i) for i in range(60)]
        assert len({(m.partition, m.offset) for m in [await f for f in futures]}) == 60
        records = [(name, b"t%d" % i, b"from a thread") for i in range(40)]
        assert await asyncio.to_thread(client.send_many_blocking, records, 10.0) == 40
    finally:
        await close_quietly([client])
    assert len(await records_of(settings, TopicKey.SPANS, 100)) == 100


async def test_the_runner_publishes_through_it(settings: FulmenSettings) -> None:
    """Lifecycle events through EventPublisher on this producer, spans from the SDK's thread (the runner test
    with its client switched)."""
    from tests.integration.test_runner_kafka_spans import test_spans_reach_the_topic_without_the_otlp_gateway

    await test_spans_reach_the_topic_without_the_otlp_gateway(on_librdkafka(settings))


async def test_no_broker_is_a_clear_error_not_a_hang() -> None:
    settings = FulmenSettings(
        kafka={"bootstrap": f"127.0.0.1:{free_port()}", "connect_timeout_s": 2.0, "client": "librdkafka"}
    )
    started = time.monotonic()
    with pytest.raises(BrokerUnavailableError, match=r"no Kafka broker answered at 127\.0\.0\.1:\d+ within 2s"):
        await start_or_raise(producer(settings), settings, "test producer")
    assert time.monotonic() - started < 10


async def test_a_broker_stopped_under_it_fails_a_publish_in_time(tmp_path: Path) -> None:
    broker = LocalKafka(BrokerSettings(port=free_port(), controller_port=free_port()), tmp_path / "kafka")
    await asyncio.to_thread(broker.start)
    settings = FulmenSettings(kafka={"bootstrap": broker.bootstrap, "connect_timeout_s": 3.0, "client": "librdkafka"})
    try:
        await ensure_topics(settings)
        client = producer(settings, linger_ms=0)
        await start_or_raise(client, settings)
        publisher = EventPublisher(_NoBroker(), timeout_s=5, producer=client)
        await publisher.publish(TopicKey.MODELS, ModelVersion(model_name="m", version=1, uri="x"))
        await asyncio.to_thread(broker.stop)
        started = time.monotonic()
        with pytest.raises(BrokerUnavailableError, match="fulmen.models failed: no acknowledgement within 5s"):
            await publisher.publish(TopicKey.MODELS, ModelVersion(model_name="m", version=2, uri="y"))
        assert time.monotonic() - started < 20
        with pytest.raises(KafkaError):
            await asyncio.to_thread(client.send_many_blocking, [("fulmen.models", b"k", b"v")], 2.0)
        await close_quietly([client], timeout_s=2)
    finally:
        await asyncio.to_thread(broker.stop)


class _NoBroker:
    """A registrar for the publisher's declarations only: its records go through the given producer."""

    def publisher(self, topic: str, **kwargs: object) -> object:
        return type("Declared", (), {"topic": topic})()


def test_its_guarantees_cannot_be_turned_off_and_unknown_options_are_refused() -> None:
    base = {"bootstrap_servers": ["a:9092", "b:9092"], "client_id": "c", "linger_ms": 0}
    config = rdkafka_config(base)
    assert config["bootstrap.servers"] == "a:9092,b:9092"
    assert (config["acks"], config["enable.idempotence"], config["linger.ms"]) == ("all", True, 0)
    with pytest.raises(ValueError, match="acks=all"):
        rdkafka_config({**base, "acks": 1})
    with pytest.raises(ValueError, match="idempotent"):
        rdkafka_config({**base, "enable_idempotence": False})
    with pytest.raises(ValueError, match="does not take 'retry_backoff_ms'"):
        rdkafka_config({**base, "retry_backoff_ms": 10})
    sized = rdkafka_config({**base, "max_batch_size": 4 << 20, "max_request_size": 1 << 20})
    assert sized["batch.size"] == 1 << 20  # a batch never larger than a request may be
