"""Against a real Kafka broker: every event type travels, groups resume, topics carry their settings."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from fulmen.infra.kafka.admin import describe_topics, ensure_topics
from fulmen.infra.kafka.broker import kafka_broker
from fulmen.infra.kafka.clients import admin_client, close_quietly, consumer, producer, start_or_raise
from fulmen.infra.kafka.local import LocalKafka
from fulmen.infra.kafka.publish import EventPublisher, Sender
from fulmen.infra.processes import free_port
from fulmen.infra.settings import BrokerSettings, FulmenSettings
from fulmen.schemas import (
    TOPICS,
    ModelVersion,
    RolloutEvent,
    RolloutRequest,
    RolloutStatus,
    TopicKey,
    TrainStep,
    Transition,
    TransitionBatch,
    decode,
    topic,
    topic_name,
)
from fulmen.schemas.errors import BrokerUnavailableError
from fulmen.testing.publishing import event_publisher

pytestmark = pytest.mark.integration


def one_of_each() -> dict[TopicKey, object]:
    call = Transition(
        rollout_id="r1",
        attempt=2,
        index=0,
        trace_id="c" * 32,
        span_id="d" * 16,
        prompt_token_ids=[5, 6],
        response_token_ids=[7],
        response_logprobs=[-0.5],
    )
    return {
        TopicKey.TASKS: RolloutRequest(rollout_id="r1", task_id="t1", group_id="g1", input={"q": "2+2"}),
        TopicKey.ROLLOUTS: RolloutEvent(
            rollout_id="r1", attempt=2, status=RolloutStatus.SUCCEEDED, task_id="t1", group_id="g1", reward=1.0
        ),
        TopicKey.TRANSITIONS: TransitionBatch(
            rollout_id="r1",
            attempt=2,
            task_id="t1",
            group_id="g1",
            status=RolloutStatus.SUCCEEDED,
            episode_reward=1.0,
            transitions=[call],
        ),
        TopicKey.MODELS: ModelVersion(model_name="tiny", version=3, uri="/ckpt/3"),
        TopicKey.METRICS: TrainStep(
            run_id="run1",
            step=3,
            model_version=3,
            num_transitions=8,
            num_groups=2,
            reward_mean=0.5,
            reward_std=0.1,
            loss=0.01,
        ),
    }


async def test_every_event_type_travels_keyed_as_registered(settings: FulmenSettings) -> None:
    prefix = settings.kafka.topic_prefix
    events = one_of_each()
    async with event_publisher(settings) as publisher:
        for key, event in events.items():
            metadata = await publisher.publish(key, event)
            assert metadata.topic == topic_name(key, prefix) == publisher.topic_name(key)  # the broker's prefix
    for key, sent in events.items():
        reader = consumer(settings, f"reader-{key.value}", topic_name(key, prefix))
        await start_or_raise(reader, settings)
        try:
            record = await asyncio.wait_for(reader.getone(), 20)
        finally:
            await reader.stop()
        assert decode(type(sent), record.value) == sent
        assert record.key == str(getattr(sent, topic(key).record_key)).encode()


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
async def test_compressed_batches_travel_and_are_stored_compressed(
    settings: FulmenSettings, kafka_broker: LocalKafka, codec: str
) -> None:
    """FULMEN_KAFKA_COMPRESSION: both producers (the span producer and the event publisher) write batches in the
    codec, the broker stores them so (the topic's log is a fraction of the records' size), a consumer reads them."""
    settings = settings.model_copy(update={"kafka": settings.kafka.model_copy(update={"compression": codec})})
    prefix = settings.kafka.topic_prefix
    spans = topic_name(TopicKey.SPANS, prefix)
    body = b"span attribute " * 700  # ~10 KB a record, very compressible
    raw = producer(settings)
    await start_or_raise(raw, settings)
    try:
        for i in range(50):
            await raw.send(spans, body + str(i).encode(), key=str(i).encode())
        await raw.flush()
    finally:
        await raw.stop()
    async with event_publisher(settings) as publisher:
        await publisher.publish_many(
            TopicKey.METRICS,
            [
                TrainStep(
                    run_id="run",
                    step=i,
                    model_version=i,
                    num_transitions=1,
                    num_groups=1,
                    reward_mean=0,
                    reward_std=0,
                    loss=0,
                )
                for i in range(3)
            ],
        )
    reader = consumer(settings, "compressed", spans, topic_name(TopicKey.METRICS, prefix))
    await start_or_raise(reader, settings)
    try:
        got: list = []
        while len(got) < 53:
            batches = await asyncio.wait_for(reader.getmany(timeout_ms=1000), 20)
            got += [r for records in batches.values() for r in records]
    finally:
        await reader.stop()
    assert sorted(r.value for r in got if r.topic == spans) == sorted(body + str(i).encode() for i in range(50))
    assert sorted(decode(TrainStep, r.value).step for r in got if r.topic != spans) == [0, 1, 2]
    stored = sum(f.stat().st_size for f in kafka_broker.logs_dir.glob(f"{spans}-*/*.log"))
    assert 0 < stored < 50 * len(body) / 5, f"{codec}: {stored} bytes on disk for {50 * len(body)} bytes of records"


async def test_publishing_the_wrong_event_or_an_undeclared_topic_is_refused(settings: FulmenSettings) -> None:
    async with event_publisher(settings, sender=Sender("test", (TopicKey.TASKS,))) as publisher:
        with pytest.raises(TypeError, match="carries RolloutRequest, not ModelVersion"):
            await publisher.publish(TopicKey.TASKS, ModelVersion(model_name="m", version=1, uri="x"))
        with pytest.raises(ValueError, match="test publishes to tasks, not to models"):
            await publisher.publish(TopicKey.MODELS, ModelVersion(model_name="m", version=1, uri="x"))


async def test_a_group_resumes_from_its_committed_offset(settings: FulmenSettings) -> None:
    prefix = settings.kafka.topic_prefix
    name = topic_name(TopicKey.METRICS, prefix)
    broker = kafka_broker(settings)
    await start_or_raise(broker, settings)
    publisher = EventPublisher(broker)

    def step(i: int) -> TrainStep:
        return TrainStep(
            run_id="run", step=i, model_version=i, num_transitions=1, num_groups=1, reward_mean=0, reward_std=0, loss=0
        )

    await publisher.publish_many(TopicKey.METRICS, [step(i) for i in range(6)])

    async def read(n: int, commit_after: int | None) -> list[int]:
        reader = consumer(settings, "resumer", name)
        await start_or_raise(reader, settings)
        seen = []
        try:
            while len(seen) < n:
                record = await asyncio.wait_for(reader.getone(), 20)
                seen.append(decode(TrainStep, record.value).step)
                if commit_after is not None and len(seen) == commit_after:
                    await reader.commit()
        finally:
            await reader.stop()
        return seen

    assert await read(4, commit_after=3) == [0, 1, 2, 3]  # read 4, committed after 3
    await publisher.publish_many(TopicKey.METRICS, [step(i) for i in range(6, 8)])
    await close_quietly([broker])
    assert await read(5, commit_after=None) == [3, 4, 5, 6, 7]  # the uncommitted one comes again


async def test_topics_are_created_with_their_settings(settings: FulmenSettings) -> None:
    states = {s.key: s for s in await describe_topics(settings)}
    for key, spec in TOPICS.items():
        state = states[key.value]
        assert state.exists and state.partitions == spec.partitions
        for name, value in spec.config.items():
            assert state.config[name] == value
    assert states["models"].config["cleanup.policy"] == "compact"


async def test_ensure_topics_repairs_drift_and_keeps_foreign_settings(settings: FulmenSettings) -> None:
    models = topic_name(TopicKey.MODELS, settings.kafka.topic_prefix)
    admin = admin_client(settings)
    await start_or_raise(admin, settings)
    try:
        await admin.alter_configs(
            [ConfigResource(ConfigResourceType.TOPIC, models, {"cleanup.policy": "delete", "segment.ms": "3600000"})]
        )
    finally:
        await admin.close()
    async with asyncio.timeout(30):  # the broker applies a config change asynchronously
        while {s.key: s for s in await describe_topics(settings)}["models"].config.get("cleanup.policy") != "delete":
            await asyncio.sleep(0.2)
    states = {s.key: s for s in await ensure_topics(settings)}
    assert states["models"].action == "updated"
    assert states["models"].config["cleanup.policy"] == "compact"
    assert states["models"].config["segment.ms"] == "3600000"
    assert states["tasks"].action == "unchanged"


async def test_no_broker_is_a_clear_error_not_a_hang(tmp_path) -> None:
    settings = FulmenSettings(kafka={"bootstrap": f"127.0.0.1:{free_port()}", "connect_timeout_s": 2.0})
    started = time.monotonic()
    with pytest.raises(BrokerUnavailableError, match=r"no Kafka broker answered at 127\.0\.0\.1:\d+ within 2s"):
        await start_or_raise(producer(settings), settings, "test producer")
    assert time.monotonic() - started < 10
    kafka = kafka_broker(settings)  # the faststream broker is bounded the same way
    started = time.monotonic()
    try:
        with pytest.raises(BrokerUnavailableError, match=r"test publisher: no Kafka broker answered at 127\.0\.0\.1"):
            await start_or_raise(kafka, settings, "test publisher")
    finally:
        await close_quietly([kafka], timeout_s=2)
    assert time.monotonic() - started < 10


async def test_a_broker_stopped_under_a_producer_is_a_clear_error(tmp_path) -> None:
    broker = LocalKafka(BrokerSettings(port=free_port(), controller_port=free_port()), tmp_path / "kafka")
    await asyncio.to_thread(broker.start)
    settings = FulmenSettings(kafka={"bootstrap": broker.bootstrap, "connect_timeout_s": 3.0})
    try:
        await ensure_topics(settings)
        kafka = kafka_broker(settings)
        await start_or_raise(kafka, settings)
        publisher = EventPublisher(kafka, timeout_s=5)
        await publisher.publish(TopicKey.MODELS, ModelVersion(model_name="m", version=1, uri="x"))
        await asyncio.to_thread(broker.stop)
        started = time.monotonic()
        with pytest.raises(
            BrokerUnavailableError, match="publishing to fulmen.models failed: no acknowledgement within 5s"
        ):
            await publisher.publish(TopicKey.MODELS, ModelVersion(model_name="m", version=2, uri="y"))
        assert time.monotonic() - started < 20
        await close_quietly([kafka], timeout_s=2)
    finally:
        await asyncio.to_thread(broker.stop)
