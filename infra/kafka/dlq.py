"""The dead-letter topic: park a record that cannot be processed, with where it came from and why.

The record keeps its original key and value bytes; the reason travels in headers (``DeadLetterHeaders``), so
the stream goes on and the record can be replayed once the cause is fixed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord
from prometheus_client import Counter

from fulmen.schemas.events import DeadLetterHeaders
from fulmen.schemas.topics import TopicKey, group_name, topic_name

__all__ = ["DEAD_LETTERS", "DeadLetters"]

log = logging.getLogger(__name__)

DEAD_LETTERS = Counter(
    "fulmen_dead_letters_total",
    "records sent to the dead-letter topic, by source topic and error type",
    ["topic", "reason"],
)

_MAX_ERROR_CHARS = 2000


class DeadLetters:
    """Sends records to the dead-letter topic. Await :meth:`flush` before committing the source offsets."""

    def __init__(self, producer: AIOKafkaProducer, *, prefix: str = "", consumer_group: str = "") -> None:
        self.producer = producer
        self.topic = topic_name(TopicKey.DLQ, prefix)
        # the configured group name, resolved as the consumer joined it (prefixed when it is one of Fulmen's)
        self.consumer_group = group_name(consumer_group, prefix) if consumer_group else ""
        self._pending: list[asyncio.Future[Any]] = []
        self.sent = 0

    async def send(self, record: ConsumerRecord, error: BaseException) -> None:
        headers = DeadLetterHeaders(
            source_topic=record.topic,
            source_partition=record.partition,
            source_offset=record.offset,
            error_type=type(error).__name__,
            error=str(error)[:_MAX_ERROR_CHARS],
            consumer_group=self.consumer_group,
        )
        log.warning("dead-lettered %s[%d]@%d: %s", record.topic, record.partition, record.offset, headers.error)
        future = await self.producer.send(self.topic, value=record.value, key=record.key, headers=headers.to_kafka())
        self._pending.append(future)
        self.sent += 1
        DEAD_LETTERS.labels(record.topic, headers.error_type).inc()

    async def flush(self) -> None:
        """Wait until the broker acknowledged every record sent so far (raises if one failed)."""
        pending, self._pending = self._pending, []
        if pending:
            await asyncio.gather(*pending)
