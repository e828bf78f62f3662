"""The consumers process against a real broker and the embedded store: once, in order, nothing lost."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiokafka import TopicPartition

from fulmen.consumers import ConsumerOptions, ConsumersApp, default_sinks
from fulmen.infra.kafka.clients import consumer, producer, start_or_raise
from fulmen.infra.kafka.publish import EventPublisher
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store
from fulmen.schemas import DeadLetterHeaders, RolloutEvent, RolloutStatus, TopicKey, topic_name
from tests.polling import count_reaches

pytestmark = pytest.mark.integration


def running(i: int, status: RolloutStatus = RolloutStatus.RUNNING) -> RolloutEvent:
    return RolloutEvent(rollout_id=f"r{i}", attempt=1, status=status, task_id=f"t{i}", group_id="g",
                        reward=1.0 if status is RolloutStatus.SUCCEEDED else None)  # fmt: skip


@asynccontextmanager
async def consumers_running(settings: FulmenSettings, store: Store) -> AsyncIterator[ConsumersApp]:
    stop, ready = asyncio.Event(), asyncio.Event()
    app = ConsumersApp(settings, store, default_sinks(), ConsumerOptions(max_wait_s=0.1))
    task = asyncio.create_task(app.run(stop, ready))
    await asyncio.wait_for(ready.wait(), 60)
    try:
        yield app
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


@asynccontextmanager
async def publisher_for(settings: FulmenSettings) -> AsyncIterator[EventPublisher]:
    kafka_producer = producer(settings)
    await start_or_raise(kafka_producer, settings)
    try:
        yield EventPublisher(kafka_producer, prefix=settings.kafka.topic_prefix)
    finally:
        await kafka_producer.stop()


async def wait_rows(store: Store, sql: str, expected: int, timeout_s: float = 30) -> int:
    return await count_reaches(store, sql, expected, timeout_s)


async def test_events_land_once_even_when_delivered_twice(settings: FulmenSettings, linked_store: Store) -> None:
    db = linked_store.database
    async with publisher_for(settings) as publisher, consumers_running(settings, linked_store):
        events = [running(i) for i in range(50)]
        await publisher.publish_many(TopicKey.ROLLOUTS, events)
        await publisher.publish_many(TopicKey.ROLLOUTS, events[:20])  # a producer retry / replay
        await publisher.publish_many(TopicKey.ROLLOUTS, [running(i, RolloutStatus.SUCCEEDED) for i in range(10)])
        assert await wait_rows(linked_store, f"SELECT count() FROM {db}.rollouts", 50) == 50
        await asyncio.sleep(0.5)
    rows = linked_store.query(f"SELECT Status, count() FROM {db}.rollouts GROUP BY Status ORDER BY Status").rows
    assert rows == [["running", 40], ["succeeded", 10]]


async def test_a_poison_record_is_dead_lettered_and_later_records_land(
    settings: FulmenSettings, linked_store: Store
) -> None:
    db, prefix = linked_store.database, settings.kafka.topic_prefix
    rollouts = topic_name(TopicKey.ROLLOUTS, prefix)
    async with publisher_for(settings) as publisher, consumers_running(settings, linked_store):
        await publisher.publish(TopicKey.ROLLOUTS, running(1))
        await publisher.producer.send_and_wait(rollouts, b'{"rollout_id": 7}', key=b"r1", partition=0)
        await publisher.publish(TopicKey.ROLLOUTS, running(2))
        assert await wait_rows(linked_store, f"SELECT count() FROM {db}.rollouts", 2) == 2

    reader = consumer(settings, None)
    await start_or_raise(reader, settings)
    try:
        tp = TopicPartition(topic_name(TopicKey.DLQ, prefix), 0)
        reader.assign([tp])
        await reader.seek_to_beginning(tp)
        record = (await reader.getmany(tp, timeout_ms=10_000))[tp][0]
    finally:
        await reader.stop()
    headers = DeadLetterHeaders.from_kafka(record.headers)
    assert record.value == b'{"rollout_id": 7}' and record.key == b"r1"
    assert headers.source_topic == rollouts and headers.source_partition == 0
    assert "RolloutEvent.rollout_id" in headers.error and headers.consumer_group.endswith(".rollouts")


async def test_a_restarted_consumer_resumes_where_it_committed(settings: FulmenSettings, linked_store: Store) -> None:
    db = linked_store.database
    async with publisher_for(settings) as publisher:
        async with consumers_running(settings, linked_store) as first:
            await publisher.publish_many(TopicKey.ROLLOUTS, [running(i) for i in range(30)])
            assert await wait_rows(linked_store, f"SELECT count() FROM {db}.rollouts", 30) == 30
        await publisher.publish_many(TopicKey.ROLLOUTS, [running(i) for i in range(30, 45)])
        async with consumers_running(settings, linked_store) as second:
            assert await wait_rows(linked_store, f"SELECT count() FROM {db}.rollouts", 45) == 45
    # Read the counters once both runs have stopped (a batch's counters move after its commit).
    assert sum(w.stats.records for w in first.workers if w.sink.name == "rollouts") == 30
    # Only what arrived while it was down: nothing re-read, nothing skipped.
    assert sum(w.stats.records for w in second.workers if w.sink.name == "rollouts") == 15
