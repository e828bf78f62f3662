"""Publish Fulmen's events through a faststream broker: keyed as the topic registry says, acknowledged before returning.

A component names what it publishes in a :class:`Sender` (its name and the topics it sends to) and publishes
through an :class:`EventPublisher` built on the broker of :func:`fulmen.infra.kafka.broker.kafka_broker`. The
publisher declares one faststream publisher per topic of the sender: those declarations are what the AsyncAPI
document lists as the component's send operations (and give the topic its prefix), and a publish to any other
topic is refused. The records themselves go straight to the broker's own aiokafka producer
(:func:`~fulmen.infra.kafka.broker.broker_producer`): faststream's per-message publish path (a command object, the
middleware chain, a fresh correlation id) cost more CPU than aiokafka's send, and Fulmen's events need none of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata

from fulmen.infra.kafka.broker import broker_producer, endpoint_title
from fulmen.schemas.codec import encode
from fulmen.schemas.errors import BrokerUnavailableError
from fulmen.schemas.events import Event
from fulmen.schemas.topics import TOPICS, TopicKey, topic

__all__ = ["ANY_SENDER", "EventPublisher", "Sender", "Waves", "declare_publishers"]

_JSON = [("content-type", b"application/json")]  # what a faststream subscriber decodes the body by


@dataclass(frozen=True)
class Sender:
    """A component that publishes events: its name (the title of its AsyncAPI send operations) and the topics it
    sends to."""

    name: str
    topics: tuple[TopicKey, ...]

    def __post_init__(self) -> None:
        not_json = [key.value for key in self.topics if topic(key).value is None]
        if not_json:
            raise ValueError(f"{self.name}: {', '.join(not_json)} carry no JSON event for EventPublisher to send")


ANY_SENDER = Sender("fulmen", tuple(key for key, spec in TOPICS.items() if spec.value is not None))
"""Every JSON event topic, for tools and tests; a component declares its own :class:`Sender`."""


class Registrar(Protocol):
    """What a publisher is declared on: a faststream ``KafkaBroker`` or ``KafkaRouter`` (or a test's fake)."""

    def publisher(self, topic: str, **kwargs: Any) -> Any: ...


def declare_publishers(registrar: Registrar, sender: Sender) -> dict[TopicKey, Any]:
    """One faststream publisher per topic of ``sender``, titled ``<sender>:send:<topic key>`` and carrying its
    event's JSON schema; the broker adds the topic prefix."""
    return {
        key: registrar.publisher(
            topic(key).name, title=endpoint_title(sender.name, "send", key), schema=topic(key).value
        )
        for key in sender.topics
    }


class EventPublisher:
    """Sends events through the broker's idempotent producer. Each send returns once the broker acknowledged it.

    Lifecycle: build it on a ``KafkaBroker`` (not a router: it sends through the broker's producer, or through
    ``producer`` when one is given; started before the first publish, stopped by its owner), publish, and
    :meth:`settle` before looking whether an earlier unacknowledged record landed.

    The idempotent producer retries an unreachable broker without end; ``timeout_s`` bounds how long a caller
    waits for the acknowledgement before getting :class:`BrokerUnavailableError`. The record stays in the
    producer's buffer and may still be delivered later, once (the broker drops the producer's own resends of a
    batch by sequence number). Publishing the event again is a new record, so a caller that publishes again may
    write it twice: consumers are idempotent for that reason. A caller that must not write twice calls
    :meth:`settle` before it looks whether the first record landed, and only then publishes again.

    Raises :class:`TypeError` for an event its topic does not carry and :class:`ValueError` for a topic the
    sender did not declare.
    """

    def __init__(
        self, broker: Registrar, sender: Sender = ANY_SENDER, *, timeout_s: float = 30.0, producer: Any = None
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.broker = broker
        self.producer = producer  # None: the broker's own; else one of clients.producer's, started by its owner
        self.sender = sender
        self.timeout_s = timeout_s
        self.publishers = declare_publishers(broker, sender)
        self._topics = {key: publisher.topic for key, publisher in self.publishers.items()}  # prefixed, fixed
        self._unsettled: dict[asyncio.Future[RecordMetadata], str] = {}  # sent, unacknowledged -> topic

    async def publish(self, key: TopicKey, event: Event) -> RecordMetadata:
        return (await self.publish_many(key, [event]))[0]

    async def publish_many(self, key: TopicKey, events: Iterable[Event]) -> list[RecordMetadata]:
        """Send all, then wait for all: one round trip per producer batch, not per event.

        Raises :class:`BrokerUnavailableError` when the broker does not acknowledge in time.
        """
        name = self.topic_name(key)
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

    def topic_name(self, key: TopicKey) -> str:
        """The topic ``key`` as this publisher sends to it (with the broker's prefix)."""
        try:
            return self._topics[TopicKey(key)]
        except KeyError:
            declared = ", ".join(k.value for k in self.sender.topics)
            raise ValueError(f"{self.sender.name} publishes to {declared}, not to {key}") from None

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
        """Hand the record to the producer; the future settles with the broker's acknowledgement."""
        spec = topic(key)
        if spec.value is None or not isinstance(event, spec.value):
            expected = spec.value.__name__ if spec.value else "no JSON event"
            raise TypeError(f"topic {spec.name} carries {expected}, not {type(event).__name__}")
        name = self.topic_name(key)
        record_key = str(getattr(event, spec.record_key)).encode()
        producer = self.producer or broker_producer(self.broker)
        return await producer.send(name, encode(event), key=record_key, headers=_JSON)


class Waves:
    """Publishes the events of many concurrent callers to one topic together, a wave at a time.

    A caller's :meth:`publish_many` returns once its events are acknowledged, as :meth:`EventPublisher.publish_many`
    does; callers that arrive while a wave is out join the next one, which goes as soon as the wave before is
    acknowledged. Under load a wave carries the events of every rollout that finished meanwhile: one send loop, one
    wait and (mostly) one produce request for all of them, instead of one per caller. A caller's events stay in
    order (they go in one wave); a failed wave fails every caller in it with the publisher's error (their records
    may still land, as :class:`EventPublisher` says). One caller's cancellation leaves the wave going on.
    """

    def __init__(self, publisher: EventPublisher, key: TopicKey) -> None:
        publisher.topic_name(key)  # a topic the sender declared (ValueError otherwise)
        self.publisher = publisher
        self.key = key
        self.waves = 0  # sent so far (their count against the callers' shows what was saved)
        self._waiting: list[tuple[list[Event], asyncio.Future[None]]] = []
        self._running: asyncio.Task[None] | None = None

    async def publish_many(self, events: Iterable[Event]) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((list(events), future))
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._drain(), name=f"waves-{self.key.value}")
        try:
            await asyncio.shield(future)  # a cancelled caller does not cancel the others' wave
        except asyncio.CancelledError:
            future.add_done_callback(_retrieved)  # its outcome is nobody's now
            raise

    async def _drain(self) -> None:
        while self._waiting:
            wave, self._waiting = self._waiting, []
            self.waves += 1
            try:
                await self.publisher.publish_many(self.key, [event for events, _ in wave for event in events])
            except asyncio.CancelledError:  # the loop is going away: so are the callers
                for _, future in wave + self._waiting:
                    future.cancel()
                raise
            except Exception as exc:  # every caller of the wave gets the error
                for _, future in wave:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for _, future in wave:
                if not future.done():
                    future.set_result(None)


def _retrieved(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()
