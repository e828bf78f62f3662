"""The consumers process against a real broker and the embedded store: once, in order, nothing lost."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiokafka import TopicPartition

from fulmen.consumers import ConsumerOptions, ConsumersApp, default_sinks
from fulmen.consumers.event_sinks import SinkHandler
from fulmen.infra.kafka.clients import consumer, producer, start_or_raise
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store
from fulmen.schemas import DeadLetterHeaders, RolloutEvent, RolloutStatus, TopicKey, topic_name
from fulmen.schemas.codec import encode
from fulmen.testing.publishing import event_publisher
from tests.polling import count_reaches

pytestmark = pytest.mark.integration


def running(i: int, status: RolloutStatus = RolloutStatus.RUNNING) -> RolloutEvent:
    return RolloutEvent(
        rollout_id=f"r{i}",
        attempt=1,
        status=status,
        task_id=f"t{i}",
        group_id="g",
        reward=1.0 if status is RolloutStatus.SUCCEEDED else None,
    )


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


async def wait_rows(store: Store, sql: str, expected: int, timeout_s: float = 30) -> int:
    return await count_reaches(store, sql, expected, timeout_s)


async def test_events_land_once_even_when_delivered_twice(settings: FulmenSettings, linked_store: Store) -> None:
    db = linked_store.database
    async with event_publisher(settings) as publisher, consumers_running(settings, linked_store):
        events = [running(i) for i in range(50)]
        await publisher.publish_many(TopicKey.ROLLOUTS, events)
        await publisher.publish_many(TopicKey.ROLLOUTS, events[:20])  # a producer retry / replay
        await publisher.publish_many(TopicKey.ROLLOUTS, [running(i, RolloutStatus.SUCCEEDED) for i in range(10)])
        assert await wait_rows(linked_store, f"SELECT count() FROM {db}.rollouts", 50) == 50
        await asyncio.sleep(0.5)
    rows = linked_store.query(f"SELECT Status, count() FROM {db}.rollouts GROUP BY Status ORDER BY Status").rows
    assert rows == [["running", 40], ["succeeded", 10]]


async def test_a_poison_record_is_dead_lettered_on_its_own_and_the_records_around_it_land(
    settings: FulmenSettings, linked_store: Store
) -> None:
    """The rollouts sink runs on faststream: a record that is not an event, in the middle of a batch, goes to the
    dead-letter topic with where it came from; the good records before and after it are stored, a record whose
    header is not UTF-8 included, and the batch is committed."""
    db, prefix = linked_store.database, settings.kafka.topic_prefix
    rollouts = topic_name(TopicKey.ROLLOUTS, prefix)
    poison = b'{"rollout_id": 7'  # cut short; labelled JSON, so a library decoder would choke on it
    raw = producer(settings)
    await start_or_raise(raw, settings)
    try:
        async with consumers_running(settings, linked_store) as app:
            sends = [await raw.send(rollouts, encode(running(i)), key=f"r{i}".encode(), partition=0) for i in range(3)]
            sends.append(
                await raw.send(
                    rollouts, poison, key=b"r1", partition=0, headers=[("content-type", b"application/json")]
                )
            )
            sends.append(
                await raw.send(rollouts, encode(running(3)), key=b"r3", partition=0, headers=[("origin", b"\xff\xfe")])
            )
            sends += [await raw.send(rollouts, encode(running(i)), key=f"r{i}".encode(), partition=0) for i in (4, 5)]
            await asyncio.gather(*sends)
            assert await wait_rows(linked_store, f"SELECT count() FROM {db}.rollouts", 6) == 6
            [sink] = [w for w in app.workers if w.sink.name == "rollouts"]
            assert isinstance(sink, SinkHandler)
            async with asyncio.timeout(30):  # the counters move after the commit
                while sink.stats.committed.get(TopicPartition(rollouts, 0)) != 7:
                    await asyncio.sleep(0.05)
            assert (sink.stats.records, sink.stats.dead_lettered) == (6, 1)
            # ... and the dead-letters sink stores it with where it came from and why (the dashboard's page)
            assert await wait_rows(linked_store, f"SELECT count() FROM {db}.dead_letters", 1) == 1
    finally:
        await raw.stop()
    ids = linked_store.query(f"SELECT RolloutId FROM {db}.rollouts ORDER BY RolloutId").rows
    assert ids == [[f"r{i}"] for i in range(6)]
    [record] = await dead_letters(settings)
    headers = DeadLetterHeaders.from_kafka(record.headers)
    assert record.value == poison and record.key == b"r1"
    assert (headers.source_topic, headers.source_partition, headers.source_offset) == (rollouts, 0, 3)
    assert headers.error_type == "DecodeError" and headers.consumer_group.endswith(".rollouts")
    [row] = linked_store.query(
        f"SELECT SourceTopic, SourcePartition, SourceOffset, ErrorType, Key, ValuePreview, ValueBytes, Error "
        f"FROM {db}.dead_letters"
    ).rows
    assert row[:7] == [rollouts, 0, 3, "DecodeError", "r1", poison.decode(), len(poison)]
    assert row[7] == headers.error


async def dead_letters(settings: FulmenSettings) -> list:
    reader = consumer(settings, None)
    await start_or_raise(reader, settings)
    try:
        tp = TopicPartition(topic_name(TopicKey.DLQ, settings.kafka.topic_prefix), 0)
        reader.assign([tp])
        await reader.seek_to_beginning(tp)
        records = (await reader.getmany(tp, timeout_ms=10_000)).get(tp, [])
        await asyncio.sleep(1.0)  # anything sent twice would be there by now
        return records + (await reader.getmany(tp, timeout_ms=500)).get(tp, [])
    finally:
        await reader.stop()


async def test_a_restarted_consumer_resumes_where_it_committed(settings: FulmenSettings, linked_store: Store) -> None:
    db = linked_store.database
    async with event_publisher(settings) as publisher:
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
