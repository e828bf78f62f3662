"""In-memory stand-ins at the network edge: a Kafka consumer and producer, a faststream broker, and a store.

They implement only what Fulmen calls, with the same semantics that matter to the tests: a consumer hands out
records in offset order per partition and remembers commits; a producer acknowledges through futures; a broker
declares publishers that hand each record to such a producer (its ``send`` gives the delivery future); the
store keeps every inserted Arrow table and can be told to fail.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, TopicPartition

from fulmen.schemas.errors import RetryableError


def record(topic: str, partition: int, offset: int, value: bytes | None, key: bytes | None = None) -> ConsumerRecord:
    return ConsumerRecord(
        topic=topic,
        partition=partition,
        offset=offset,
        timestamp=0,
        timestamp_type=0,
        key=key,
        value=value,
        checksum=None,
        serialized_key_size=len(key or b""),
        serialized_value_size=len(value or b""),
        headers=(),
    )


class FakeConsumer:
    def __init__(self) -> None:
        self.log: dict[TopicPartition, list[ConsumerRecord]] = defaultdict(list)
        self.position: dict[TopicPartition, int] = defaultdict(int)
        self.committed: dict[TopicPartition, int] = {}
        self.commit_calls = 0
        self.events: list[str] = []  # order of effects, shared with the store and producer

    def append(self, topic: str, partition: int, value: bytes | None, key: bytes | None = None) -> None:
        tp = TopicPartition(topic, partition)
        self.log[tp].append(record(topic, partition, len(self.log[tp]), value, key))

    def assignment(self) -> set[TopicPartition]:
        return set(self.log)

    async def getmany(self, *partitions: TopicPartition, timeout_ms: int = 0, max_records: int | None = None):
        out: dict[TopicPartition, list[ConsumerRecord]] = {}
        budget = max_records or 10**9
        for tp, records in self.log.items():
            pending = records[self.position[tp] :][:budget]
            if pending:
                out[tp] = pending
                self.position[tp] += len(pending)
                budget -= len(pending)
        if not out:
            await asyncio.sleep(min(timeout_ms, 20) / 1000)
        return out

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.position[tp] = offset
        self.events.append("seek")

    async def commit(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        self.commit_calls += 1
        self.events.append("commit")
        for tp, meta in offsets.items():
            self.committed[tp] = meta.offset


class PausingConsumer(FakeConsumer):
    """A :class:`FakeConsumer` that can pause partitions: a paused one hands out nothing until resumed."""

    def __init__(self) -> None:
        super().__init__()
        self._paused: set[TopicPartition] = set()

    def pause(self, *partitions: TopicPartition) -> None:
        self._paused.update(partitions)

    def resume(self, *partitions: TopicPartition) -> None:
        self._paused.difference_update(partitions)

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    async def getmany(self, *partitions: TopicPartition, timeout_ms: int = 0, max_records: int | None = None):
        saved = {tp: self.log.pop(tp) for tp in self._paused if tp in self.log}
        try:
            return await super().getmany(timeout_ms=timeout_ms, max_records=max_records)
        finally:
            self.log.update(saved)

    def assignment(self) -> set[TopicPartition]:
        return set(self.log) | self._paused


class FakeProducer:
    def __init__(self, events: list[str]) -> None:
        self.sent: list[dict[str, Any]] = []
        self.events = events

    async def send(self, topic: str, value: bytes | None = None, key: bytes | None = None, headers: Any = None):
        self.sent.append({"topic": topic, "value": value, "key": key, "headers": list(headers or [])})
        self.events.append("dlq-send")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


class FakeBroker:
    """What :class:`~fulmen.infra.kafka.publish.EventPublisher` uses of a faststream ``KafkaBroker``: declared
    publishers (their prefixed topic) and the started broker's aiokafka producer, where
    :func:`~fulmen.infra.kafka.broker.broker_producer` finds it."""

    def __init__(self, producer: Any, prefix: str = "") -> None:
        self.producer = producer
        self.prefix = prefix
        self.declared: list[dict[str, Any]] = []
        self.config = SimpleNamespace(producer=SimpleNamespace(_producer=SimpleNamespace(producer=producer)))

    def publisher(self, topic: str, **kwargs: Any) -> _FakePublisher:
        self.declared.append({"topic": topic, **kwargs})
        return _FakePublisher(self, f"{self.prefix}{topic}")

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


class _FakePublisher:
    def __init__(self, broker: FakeBroker, topic: str) -> None:
        self.broker = broker
        self.topic = topic


class FakeStore:
    def __init__(self, events: list[str], failures: int = 0) -> None:
        self.tables: dict[str, list[pa.Table]] = defaultdict(list)
        self.failures = failures
        self.events = events

    def insert_batch(self, table: str, data: pa.Table) -> int:
        if self.failures:
            self.failures -= 1
            self.events.append("insert-failed")
            raise RetryableError("store down (fake)")
        self.tables[table].append(data)
        self.events.append("insert")
        return data.num_rows

    def rows(self, table: str) -> list[dict[str, Any]]:
        return [row for t in self.tables[table] for row in t.to_pylist()]
