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
    """Sends events with a started idempotent producer. Each send returns once the broker acknowledged it.

    aiokafka's idempotent producer retries an unreachable broker without end; ``timeout_s`` bounds how long a
    caller waits for the acknowledgement before getting :class:`BrokerUnavailableError`. The record may still
    be delivered later by the producer's retries, so a caller that publishes again may write it twice:
    consumers are idempotent for that reason.
    """

    def __init__(self, producer: AIOKafkaProducer, *, prefix: str = "", timeout_s: float = 30.0) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.producer = producer
        self.prefix = prefix
        self.timeout_s = timeout_s

    async def publish(self, key: TopicKey, event: Event) -> RecordMetadata:
        return (await self.publish_many(key, [event]))[0]

    async def publish_many(self, key: TopicKey, events: Iterable[Event]) -> list[RecordMetadata]:
        """Send all, then wait for all: one round trip per producer batch, not per event.

        Raises :class:`BrokerUnavailableError` when the broker does not acknowledge in time.
        """
        name = topic_name(key, self.prefix)
        try:
            async with asyncio.timeout(self.timeout_s):
                futures = [await self._send(key, event) for event in events]
                return list(await asyncio.gather(*futures))
        except TimeoutError:
            raise BrokerUnavailableError(
                f"publishing to {name} failed: no acknowledgement within {self.timeout_s:g}s", topic=name
            ) from None
        except KafkaError as exc:
            raise BrokerUnavailableError(
                f"publishing to {name} failed: {type(exc).__name__}: {exc}", topic=name
            ) from exc

    async def _send(self, key: TopicKey, event: Event) -> asyncio.Future[RecordMetadata]:
        spec = topic(key)
        if spec.value is None or not isinstance(event, spec.value):
            expected = spec.value.__name__ if spec.value else "no JSON event"
            raise TypeError(f"topic {spec.name} carries {expected}, not {type(event).__name__}")
        record_key = str(getattr(event, spec.record_key)).encode()
        return await self.producer.send(topic_name(key, self.prefix), value=encode(event), key=record_key)
