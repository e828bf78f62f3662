"""The batch consumer's acknowledgement policy, against in-memory fakes (the real broker: integration tests)."""

from __future__ import annotations

import asyncio

import pyarrow as pa

from fulmen.consumers.batch import BatchConsumer
from fulmen.consumers.event_sinks import EVENT_SINKS
from fulmen.infra.kafka.dlq import DeadLetters
from fulmen.schemas import DeadLetterHeaders, RolloutEvent, RolloutStatus, encode
from tests.fakes import FakeConsumer, FakeProducer, FakeStore

TOPIC = "fulmen.rollouts"


def _event(i: int, status: RolloutStatus = RolloutStatus.RUNNING) -> bytes:
    return encode(RolloutEvent(rollout_id=f"r{i}", attempt=1, status=status, task_id="t", group_id="g"))


def _build(
    failures: int = 0, max_records: int = 100, max_bytes: int = 2**20
) -> tuple[BatchConsumer, FakeConsumer, FakeProducer, FakeStore]:
    consumer = FakeConsumer()
    producer = FakeProducer(consumer.events)
    store = FakeStore(consumer.events, failures)
    worker = BatchConsumer(
        EVENT_SINKS["rollouts"],
        consumer,
        store,
        DeadLetters(producer, consumer_group="g"),  # type: ignore[arg-type]
        max_records=max_records,
        max_bytes=max_bytes,
        max_wait_s=0.05,
        retry_backoff_s=0.001,
    )
    return worker, consumer, producer, store


async def _drain(worker: BatchConsumer, polls: int = 5) -> None:
    for _ in range(polls):
        await worker.poll_once()
        await asyncio.sleep(0.06)
    await worker.flush()


async def test_rows_are_inserted_before_offsets_are_committed() -> None:
    worker, consumer, _, store = _build()
    for i in range(10):
        consumer.append(TOPIC, i % 3, _event(i))
    await _drain(worker)
    assert sorted(r["RolloutId"] for r in store.rows("rollouts")) == [f"r{i}" for i in range(10)]
    assert consumer.committed == {tp: len(records) for tp, records in consumer.log.items()}
    assert consumer.events.index("insert") < consumer.events.index("commit")


async def test_poison_goes_to_the_dead_letter_topic_and_the_stream_goes_on() -> None:
    worker, consumer, producer, store = _build()
    consumer.append(TOPIC, 0, _event(1))
    consumer.append(TOPIC, 0, b"not json", key=b"k")
    consumer.append(TOPIC, 0, None)  # a tombstone is not an event either
    consumer.append(TOPIC, 0, _event(2))
    await _drain(worker)
    assert [r["RolloutId"] for r in store.rows("rollouts")] == ["r1", "r2"]
    assert [m["value"] for m in producer.sent] == [b"not json", None]
    headers = DeadLetterHeaders.from_kafka(producer.sent[0]["headers"])
    assert (headers.source_topic, headers.source_partition, headers.source_offset) == (TOPIC, 0, 1)
    assert headers.error_type == "DecodeError" and "Invalid JSON" in headers.error
    assert producer.sent[0]["key"] == b"k"
    assert consumer.committed[next(iter(consumer.log))] == 4
    assert consumer.events.index("dlq-send") < consumer.events.index("commit")


async def test_a_store_outage_is_retried_and_nothing_is_committed_until_it_ends() -> None:
    worker, consumer, _, store = _build(failures=3)
    for i in range(5):
        consumer.append(TOPIC, 0, _event(i))
    await _drain(worker)
    assert consumer.events[:4] == ["insert-failed"] * 3 + ["insert"]
    assert consumer.events.index("commit") > 3
    assert len(store.rows("rollouts")) == 5


async def test_batches_respect_max_records() -> None:
    worker, consumer, _, store = _build(max_records=4)
    for i in range(10):
        consumer.append(TOPIC, 0, _event(i))
    await _drain(worker, polls=6)
    assert [t.num_rows for t in store.tables["rollouts"]] == [4, 4, 2]
    assert consumer.commit_calls == 3


async def test_batches_respect_max_bytes() -> None:
    """A batch holds at most max_bytes of record values (it bounds the insert's memory in the store)."""
    size = len(_event(0))
    worker, consumer, _, store = _build(max_bytes=3 * size)
    for i in range(10):
        consumer.append(TOPIC, 0, _event(i))
    await _drain(worker, polls=10)
    assert [t.num_rows for t in store.tables["rollouts"]] == [3, 3, 3, 1]
    assert sorted(r["RolloutId"] for r in store.rows("rollouts")) == sorted(f"r{i}" for i in range(10))


async def test_a_record_that_decodes_but_cannot_be_stored_is_dead_lettered_alone() -> None:
    worker, consumer, producer, store = _build()
    sink = worker.sink

    class Fussy:
        name, topic, table = sink.name, sink.topic, sink.table
        decode = sink.decode

        def to_batch(self, units):
            if any(row["RolloutId"] == "r2" for rows in units for row in rows):
                raise pa.ArrowInvalid("r2 cannot be stored")
            return sink.to_batch(units)

    worker.sink = Fussy()  # type: ignore[assignment]
    for i in range(4):
        consumer.append(TOPIC, 0, _event(i))
    await _drain(worker)
    assert sorted(r["RolloutId"] for r in store.rows("rollouts")) == ["r0", "r1", "r3"]
    assert (
        len(producer.sent) == 1
        and "r2 cannot be stored" in DeadLetterHeaders.from_kafka(producer.sent[0]["headers"]).error
    )
