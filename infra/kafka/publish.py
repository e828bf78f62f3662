"""Publish Fulmen events to their topics, keyed as the topic registry says, acknowledged before returning."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata

from infra.errors import BrokerUnavailableError

from schemas.codec import encode
from schemas.events import Event
from schemas.topics import TopicKey, topic, topic_name

__all__ = ["EventPublisher"]


class EventPublisher:
    """Sends events with a started idempotent producer. Each send returns once the broker acknowledged it."""

    def __init__(self, producer: AIOKafkaProducer, *, prefix: str = "") -> None:
        self.producer = producer
        self.prefix = prefix

    async def publish(self, key: TopicKey, event: Event) -> RecordMetadata:
        return (await self.publish_many(key, [event]))[0]

    async def publish_many(self, key: TopicKey, events: Iterable[Event]) -> list[RecordMetadata]:
        """Send all, then wait for all: one round trip per producer batch, not per event.

        Raises :class:`BrokerUnavailableError` when the broker does not acknowledge in time.
        """
        try:
            futures = [await self._send(key, event) for event in events]
            return list(await asyncio.gather(*futures))
        except KafkaError as exc:
            raise BrokerUnavailableError(
                f"publishing to {topic_name(key, self.prefix)} failed: {type(exc).__name__}: {exc}",
                topic=topic_name(key, self.prefix),
            ) from exc

    async def _send(self, key: TopicKey, event: Event) -> asyncio.Future[RecordMetadata]:
        spec = topic(key)
        if spec.value is None or not isinstance(event, spec.value):
            expected = spec.value.__name__ if spec.value else "no JSON event"
            raise TypeError(f"topic {spec.name} carries {expected}, not {type(event).__name__}")
        record_key = str(getattr(event, spec.record_key)).encode()
        return await self.producer.send(topic_name(key, self.prefix), value=encode(event), key=record_key)
