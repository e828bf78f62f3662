"""The faststream ``KafkaBroker`` built from Fulmen's settings: connection, security, acknowledgement, topic prefix.

:func:`kafka_broker` maps :class:`~fulmen.infra.settings.FulmenSettings` onto a broker once: bootstrap, client id,
request timeout and SASL/SSL (validated by :func:`~fulmen.infra.kafka.clients.connection_kwargs`, so a bad setting
fails the same way for every client), an idempotent producer with ``acks="all"``, and the topic prefix. Every
publisher and subscriber declared on the broker (or on a router included in it) takes the prefix; topics and
groups are never spelled with it at a call site. Start it with :func:`~fulmen.infra.kafka.clients.start_or_raise`
(no broker within the connect timeout is a :class:`BrokerUnavailableError`), stop it with
:func:`~fulmen.infra.kafka.clients.close_quietly`.

Subscribers declare their acknowledgement: :func:`subscriber_options` never lets faststream's Kafka default
(``AckPolicy.ACK_FIRST``: auto-commit, at-most-once) apply, and topics are provisioned by
:func:`~fulmen.infra.kafka.admin.ensure_topics` with their partitions and settings, never created on the fly.

What runs on faststream and what stays on aiokafka: publishing events
(:class:`~fulmen.infra.kafka.publish.EventPublisher`), the JSON table sinks and the LLM gateway's model follower
are faststream publishers and subscribers, and the AsyncAPI document is generated from their declarations. Three
loops keep aiokafka's own consumer because they track their own offsets: the runner (``producers/runner``) commits
the lowest unfinished offset of each partition while rollouts finish out of order, and pauses partitions while its
slots are full; the transitions worker (``consumers/transitions``) holds rollouts across polls until the spans
consumer has passed a barrier and commits only what it built; the batch consumer (``consumers/batch.py``, the spans
sink) accumulates a batch across polls, overlaps its insert with the next poll and flushes on a rebalance. A
faststream subscriber polls, hands that poll's records to its handler and polls again only once the handler
returned, and its acknowledgement commits the consumer's whole position. Each of those loops keeps records in flight
across polls and commits offsets it computes (:mod:`fulmen.infra.kafka.offsets`), so on faststream it would drive
the raw consumer itself and faststream would add nothing. The trainer's collector, the gateways' span producers (raw
OTLP bytes on the hot path, with per-record in-flight accounting) and the dead-letter producer use aiokafka clients
too (:mod:`fulmen.infra.kafka.clients`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord
from faststream.kafka import KafkaBroker, Topic
from faststream.middlewares import AckPolicy
from faststream.security import BaseSecurity, SASLPlaintext, SASLScram256, SASLScram512

from fulmen.infra.kafka.clients import connection_kwargs
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas.topics import TopicKey

__all__ = ["broker_producer", "endpoint_title", "kafka_broker", "provisioned", "subscriber_options"]

log = logging.getLogger(__name__)  # faststream's own lines (per-message at DEBUG, handler errors at ERROR)


class _ProvisionedTopics(logging.Filter):
    """faststream warns, at each start of a subscriber on a consumer-only broker, that it creates no topics.
    Fulmen's topics are created by ensure_topics (:func:`provisioned`): that is the expected case, not news."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Topic creation is skipped")


log.addFilter(_ProvisionedTopics())

_SASL = {"PLAIN": SASLPlaintext, "SCRAM-SHA-256": SASLScram256, "SCRAM-SHA-512": SASLScram512}


def kafka_broker(settings: FulmenSettings, **overrides: Any) -> KafkaBroker:
    """A broker for ``settings``; ``overrides`` go to :class:`KafkaBroker` (e.g. ``linger_ms=0``,
    ``max_request_size``, ``consumer_only=True`` for a process that only subscribes).

    Raises :class:`~fulmen.schemas.errors.ConfigurationError` for SASL/SSL settings the clients cannot use.
    """
    kwargs = connection_kwargs(settings)
    options: dict[str, Any] = {
        "bootstrap_servers": kwargs["bootstrap_servers"],
        "client_id": kwargs["client_id"],
        "request_timeout_ms": kwargs["request_timeout_ms"],
        "security": _security(kwargs),
        "acks": "all",
        "enable_idempotence": True,
        "linger_ms": 5,
        "max_batch_size": 1024 * 1024,
        "logger": log,
        "log_level": logging.DEBUG,  # faststream's per-message lines; each handler logs its unit of work at INFO
    }
    if settings.kafka.compression != "none":
        options["compression_type"] = settings.kafka.compression
    options.update(overrides)
    broker = KafkaBroker(**options)
    # KafkaBroker takes no prefix (KafkaRouter and include_router do); its own config holds the field that routers
    # compose, so the publishers and subscribers declared on the broker or on its routers all take it, once.
    broker.config.broker_config.prefix = settings.kafka.topic_prefix
    return broker


def broker_producer(broker: Any) -> AIOKafkaProducer:
    """The aiokafka producer a started broker built from :func:`kafka_broker`'s options (idempotent, ``acks="all"``,
    the compression): one producer, one connection per process, whichever way a record is sent.

    faststream 0.7 keeps it in its producer's state, which raises ``IncorrectState`` before the broker started (as
    faststream's own publish does). A new broker start builds a new one, so it is looked up at each send.
    """
    return broker.config.producer._producer.producer


def _security(kwargs: dict[str, Any]) -> BaseSecurity | None:
    """The SASL/SSL options of :func:`connection_kwargs` as faststream's security object (None: plaintext)."""
    protocol = kwargs["security_protocol"]
    use_ssl = protocol in ("SSL", "SASL_SSL")
    context = kwargs.get("ssl_context")
    if protocol.startswith("SASL"):
        sasl = _SASL[kwargs["sasl_mechanism"]]  # connection_kwargs refused any other mechanism
        return sasl(kwargs["sasl_plain_username"], kwargs["sasl_plain_password"], ssl_context=context, use_ssl=use_ssl)
    return BaseSecurity(ssl_context=context, use_ssl=True) if use_ssl else None


def endpoint_title(party: str, action: str, key: TopicKey) -> str:
    """The title of a declared publisher or subscriber, and so of its AsyncAPI operation:
    ``<party>:<send|receive>:<topic key>`` (``runner:send:rollouts``)."""
    if action not in ("send", "receive"):
        raise ValueError(f"action must be send or receive, not {action!r}")
    return f"{party}:{action}:{TopicKey(key).value}"


def provisioned(name: str) -> Topic:
    """A topic a subscriber reads but never creates: :func:`~fulmen.infra.kafka.admin.ensure_topics` creates
    Fulmen's topics with their partition counts and settings (faststream would create a bare one)."""
    return Topic(name, declare=False)


def subscriber_options(
    *, group_id: str | None, ack_policy: AckPolicy, max_records: int, max_wait_s: float
) -> dict[str, Any]:
    """Keyword arguments of a batch ``broker.subscriber``, with the same consumer policy as
    :func:`~fulmen.infra.kafka.clients.consumer`: from the earliest offset when the group has none, committed
    transactions only, a generous poll interval (a slow insert does not get the member thrown out), a crashed
    member's partitions moving on after 10 s.

    ``group_id`` is the group joined as is (resolve a configured name with
    :func:`~fulmen.infra.kafka.clients.consumer_group`; None: no group, nothing committed). ``ack_policy`` is
    required: :attr:`AckPolicy.MANUAL` for a handler that commits after its effect. A batch is one poll: up to
    ``max_records`` records, and the broker holds a fetch up to ``max_wait_s`` for more (``fetch_min_bytes``), so
    batches fill under load without delaying a lone record by more than ``max_wait_s``.

    The handler gets the records as they are (``message.raw_message``): faststream decodes no body (a record
    that is not JSON must reach the handler, to be dead-lettered on its own, not fail its whole batch), and a
    header value that is not UTF-8 is dropped rather than failing the batch before the handler sees it.
    """
    if max_records < 1 or max_wait_s <= 0:
        raise ValueError("max_records must be >= 1 and max_wait_s > 0")
    wait_ms = max(1, int(max_wait_s * 1000))
    return {
        "batch": True,
        "group_id": group_id,
        "ack_policy": ack_policy,
        "max_records": max_records,
        "batch_timeout_ms": wait_ms,
        "fetch_max_wait_ms": wait_ms,
        "fetch_min_bytes": 1024 * 1024,
        "auto_offset_reset": "earliest",
        "isolation_level": "read_committed",
        "max_poll_interval_ms": 600_000,
        "session_timeout_ms": 10_000,
        "heartbeat_interval_ms": 3_000,
        "parser": _tolerant_parse,
        "decoder": _undecoded,
    }


async def _tolerant_parse(records: tuple[ConsumerRecord, ...], original: Callable[..., Awaitable[Any]]) -> Any:
    """faststream's batch parser, which decodes every header value as UTF-8; a batch holding one that is not
    (or a null one) is parsed again with those headers left out: the records' keys and values are untouched."""
    try:
        return await original(records)
    except (UnicodeDecodeError, AttributeError):
        return await original(tuple(_text_headers_only(record) for record in records))


def _text_headers_only(record: ConsumerRecord) -> ConsumerRecord:
    kept = []
    for name, value in record.headers:
        try:
            kept.append((name, value.decode()))
        except (UnicodeDecodeError, AttributeError):
            continue
    return dataclasses.replace(record, headers=tuple((name, value.encode()) for name, value in kept))


def _undecoded(message: Any) -> Any:
    """The bodies as bytes: decoding is the handler's, record by record."""
    return message.body
