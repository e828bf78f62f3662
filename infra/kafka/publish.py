"""Publish Fulmen events to their topics, keyed as the topic registry says, acknowledged before returning."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata

from fulmen.infra.errors import BrokerUnavailableError
from fulmen.schemas.codec import encode
from fulmen.schemas.events import Event
from fulmen.schemas.topics import TopicKey, topic, topic_name

__all__ = ["EventPublisher"]


class EventPublisher:
    """Sends events with a started idempotent producer. Each send returns once the broker acknowledged it.

    aiokafka's idempotent producer retries an unreachable broker without end; ``timeout_s`` bounds how long a
    caller waits for the acknowledgement before getting :class:`BrokerUnavailableError`. The record stays in
    the producer's buffer and may still be delivered later, once (the broker drops the producer's own resends
    of a batch by sequence number). Publishing the event again is a new record, so a caller that publishes
    again may write it twice: consumers are idempotent for that reason. A caller that must not write twice
    calls :meth:`settle` before it looks whether the first record landed, and only then publishes again.
    """

    def __init__(self, producer: AIOKafkaProducer, *, prefix: str = "", timeout_s: float = 30.0) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.producer = producer
        self.prefix = prefix
        self.timeout_s = timeout_s
        self._unsettled: dict[asyncio.Future[RecordMetadata], str] = {}  # sent, unacknowledged -> topic

    async def publish(self, key: TopicKey, event: Event) -> RecordMetadata:
        return (await self.publish_many(key, [event]))[0]

    async def publish_many(self, key: TopicKey, events: Iterable[Event]) -> list[RecordMetadata]:
        """Send all, then wait for all: one round trip per producer batch, not per event.

        Raises :class:`BrokerUnavailableError` when the broker does not acknowledge in time.
        """
        name = topic_name(key, self.prefix)
        futures: list[asyncio.Future[RecordMetadata]] = []
        try:
            async with asyncio.timeout(self.timeout_s):
                for event in events:
                    futures.append(await self._send(key, event))
                if futures:
                    await asyncio.wait(futures)  # unlike gather, it leaves them pending when it is cancelled
            return [future.result() for future in futures]
        except TimeoutError:
            self._track(futures, name)
            raise BrokerUnavailableError(
                f"publishing to {name} failed: no acknowledgement within {self.timeout_s:g}s", topic=name
            ) from None
        except KafkaError as exc:
            self._track(futures, name)
            raise BrokerUnavailableError(
                f"publishing to {name} failed: {type(exc).__name__}: {exc}", topic=name
            ) from exc
        except asyncio.CancelledError:
            self._track(futures, name)
            raise

    async def settle(self) -> None:
        """Wait until no record of an earlier publish that ended without its acknowledgement (timed out, failed
        or cancelled) is in the producer's buffer any more: each was acknowledged or failed for good, so none
        can land on its topic later. Then what a topic holds is final for those records: look there whether
        one landed before publishing it again. Returns at once when there are none (the normal case).

        Raises :class:`BrokerUnavailableError` when some are still unacknowledged after ``timeout_s``.
        """
        if not self._unsettled:
            return
        _, pending = await asyncio.wait(list(self._unsettled), timeout=self.timeout_s)  # leaves them pending
        if pending:
            names = sorted({self._unsettled[future] for future in pending})
            raise BrokerUnavailableError(
                f"{len(pending)} record(s) sent earlier to {', '.join(names)} still unacknowledged after "
                f"{self.timeout_s:g}s",
                topic=names[0] if len(names) == 1 else None,
            )

    def _track(self, futures: list[asyncio.Future[RecordMetadata]], name: str) -> None:
        """Keep the records still in the producer's buffer until they are acknowledged or fail (:meth:`settle`)."""
        for future in futures:
            if not future.done():
                self._unsettled[future] = name
                future.add_done_callback(self._settled)
            elif not future.cancelled():
                future.exception()  # reported by the caller's BrokerUnavailableError; not "never retrieved"

    def _settled(self, future: asyncio.Future[RecordMetadata]) -> None:
        self._unsettled.pop(future, None)
        if not future.cancelled():
            future.exception()  # its caller got BrokerUnavailableError already

    async def _send(self, key: TopicKey, event: Event) -> asyncio.Future[RecordMetadata]:
        spec = topic(key)
        if spec.value is None or not isinstance(event, spec.value):
            expected = spec.value.__name__ if spec.value else "no JSON event"
            raise TypeError(f"topic {spec.name} carries {expected}, not {type(event).__name__}")
        record_key = str(getattr(event, spec.record_key)).encode()
        return await self.producer.send(topic_name(key, self.prefix), value=encode(event), key=record_key)
