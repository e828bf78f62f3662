"""Kafka clients built from settings: an idempotent producer, manual-commit consumers, an admin client.

Acknowledgement is explicit policy here, never a library default: producers wait for all in-sync replicas
(``acks="all"``) with idempotence on, so a retried send never writes twice; consumers never auto-commit, so an
offset is committed only after its effect (an insert, a published event) is durable.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError, KafkaError, NodeNotReadyError
from aiokafka.helpers import create_ssl_context

from fulmen.infra.settings import FulmenSettings
from fulmen.schemas.errors import BrokerUnavailableError, ConfigurationError
from fulmen.schemas.topics import group_name

__all__ = [
    "admin_client",
    "call_or_raise",
    "close_quietly",
    "connection_kwargs",
    "consumer",
    "consumer_group",
    "producer",
    "start_or_raise",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


def connection_kwargs(settings: FulmenSettings) -> dict[str, Any]:
    """Bootstrap, client id and the SASL/SSL options shared by every client.

    The bootstrap servers are a list, one entry per server: aiokafka splits a string itself, but faststream's
    broker wraps a string in a list, which aiokafka then reads as one host named ``a:9092,b`` (port of the last).
    """
    kafka = settings.kafka
    kwargs: dict[str, Any] = {
        "bootstrap_servers": [server.strip() for server in settings.bootstrap.split(",") if server.strip()],
        "client_id": kafka.client_id,
        "request_timeout_ms": kafka.request_timeout_ms,
        "security_protocol": kafka.security_protocol,
    }
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        kwargs["ssl_context"] = _ssl_context(settings)
    if kafka.security_protocol.startswith("SASL"):
        _check_sasl(settings)
        kwargs["sasl_mechanism"] = kafka.sasl_mechanism or "PLAIN"
        kwargs["sasl_plain_username"] = kafka.sasl_username
        kwargs["sasl_plain_password"] = kafka.sasl_password.get_secret_value() if kafka.sasl_password else None
    return kwargs


_SASL_SUPPORTED = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


def _check_sasl(settings: FulmenSettings) -> None:
    """SASL settings the clients can use, or a :class:`ConfigurationError` saying what to set."""
    kafka = settings.kafka
    mechanism = kafka.sasl_mechanism or "PLAIN"
    if mechanism not in _SASL_SUPPORTED:
        raise ConfigurationError(
            f"FULMEN_KAFKA_SASL_MECHANISM={mechanism} is not supported (it needs a token provider that Fulmen "
            f"does not configure); supported: {', '.join(_SASL_SUPPORTED)}. Set FULMEN_KAFKA_SASL_MECHANISM to "
            "one of them with FULMEN_KAFKA_SASL_USERNAME and FULMEN_KAFKA_SASL_PASSWORD"
        )
    if not kafka.sasl_username or kafka.sasl_password is None:
        raise ConfigurationError(
            f"FULMEN_KAFKA_SECURITY_PROTOCOL={kafka.security_protocol} with SASL {mechanism} needs "
            "FULMEN_KAFKA_SASL_USERNAME and FULMEN_KAFKA_SASL_PASSWORD"
        )


def _ssl_context(settings: FulmenSettings) -> ssl.SSLContext:
    kafka = settings.kafka
    return create_ssl_context(
        cafile=str(kafka.ssl_cafile) if kafka.ssl_cafile else None,
        certfile=str(kafka.ssl_certfile) if kafka.ssl_certfile else None,
        keyfile=str(kafka.ssl_keyfile) if kafka.ssl_keyfile else None,
    )


def producer(settings: FulmenSettings, **overrides: Any) -> AIOKafkaProducer:
    """An idempotent producer with ``acks="all"``, its batches compressed with ``FULMEN_KAFKA_COMPRESSION``;
    start it with :func:`start_or_raise`. ``FULMEN_KAFKA_CLIENT=librdkafka``: the same on librdkafka
    (:class:`~fulmen.infra.kafka.rdkafka.RdkafkaProducer`, aiokafka's calls and errors)."""
    kwargs = connection_kwargs(settings)
    kwargs.update(acks="all", enable_idempotence=True, linger_ms=5, max_batch_size=1024 * 1024)
    if settings.kafka.compression != "none":
        kwargs["compression_type"] = settings.kafka.compression
    kwargs.update(overrides)
    if settings.kafka.client == "librdkafka":
        from fulmen.infra.kafka.rdkafka import RdkafkaProducer, rdkafka_config

        kafka = settings.kafka
        files = {"ssl_cafile": kafka.ssl_cafile, "ssl_certfile": kafka.ssl_certfile, "ssl_keyfile": kafka.ssl_keyfile}
        if "ssl_context" in kwargs:
            kwargs.update({name: path for name, path in files.items() if path is not None})
        return RdkafkaProducer(rdkafka_config(kwargs))  # type: ignore[return-value]  # aiokafka's calls, duck-typed
    return AIOKafkaProducer(**kwargs)


def consumer_group(settings: FulmenSettings, group_id: str) -> str:
    """The group id actually joined for a configured ``group_id``: Fulmen's own group names take the topic
    prefix (:func:`fulmen.schemas.topics.group_name`); an explicitly chosen id is kept as given. Use it wherever a
    group is named to the broker (admin calls, dead-letter headers) so they match what :func:`consumer` joins."""
    return group_name(group_id, settings.kafka.topic_prefix)


def consumer(settings: FulmenSettings, group_id: str | None, *topics: str, **overrides: Any) -> AIOKafkaConsumer:
    """A consumer that never auto-commits and starts from the earliest offset when its group has none.

    ``group_id`` is the configured name; the group joined is :func:`consumer_group` of it (None: no group).

    ``max_poll_interval_ms`` is generous so a slow batch (a store insert, a long rollout) does not get the
    consumer thrown out of its group.
    """
    kwargs = connection_kwargs(settings)
    kwargs.update(
        group_id=consumer_group(settings, group_id) if group_id is not None else None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
        max_poll_interval_ms=600_000,
        session_timeout_ms=10_000,  # a crashed member's partitions move on after 10 s
        heartbeat_interval_ms=3_000,
    )
    kwargs.update(overrides)
    return AIOKafkaConsumer(*topics, **kwargs)


class _LiveNodeAdminClient(AIOKafkaAdminClient):
    """aiokafka's admin client, except that a request for any broker (metadata, topic configs) goes to one that
    answers: aiokafka picks a random known broker and fails with NodeNotReadyError when that one is down, which
    in a cluster that just lost a node is one request in three until the cluster's metadata drops the node."""

    async def _send_request(self, request: Any, node_id: int | None = None) -> Any:
        if node_id is not None:
            return await super()._send_request(request, node_id)
        nodes = [broker.nodeId for broker in self._client.cluster.brokers()]
        random.shuffle(nodes)
        for node in nodes:
            if await self._client.ready(node):
                return await self._client.send(node, request)
        raise NodeNotReadyError(f"none of the known brokers ({', '.join(map(str, nodes))}) accepts a connection")


def admin_client(settings: FulmenSettings, **overrides: Any) -> AIOKafkaAdminClient:
    kwargs = connection_kwargs(settings)
    kwargs.update(overrides)
    return _LiveNodeAdminClient(**kwargs)


async def start_or_raise(client: Any, settings: FulmenSettings, what: str = "Kafka client") -> None:
    """Start an aiokafka client, turning "no broker" into a :class:`BrokerUnavailableError` within the
    configured connect timeout instead of a hang or a bare library error."""
    await call_or_raise(client.start, settings, what)


async def call_or_raise(fn: Callable[[], Awaitable[T]], settings: FulmenSettings, what: str) -> T:
    timeout = settings.kafka.connect_timeout_s
    try:
        return await asyncio.wait_for(fn(), timeout=timeout)
    except (TimeoutError, KafkaConnectionError, KafkaError, OSError) as exc:
        raise BrokerUnavailableError(_unreachable(settings, what, exc)) from exc


def _unreachable(settings: FulmenSettings, what: str, exc: BaseException) -> str:
    hint = (
        "start the local broker with `fulmen kafka up`"
        if settings.local_kafka
        else "check FULMEN_KAFKA_BOOTSTRAP and the SASL/SSL settings"
    )
    reason = type(exc).__name__ if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
    return (
        f"{what}: no Kafka broker answered at {settings.bootstrap} within "
        f"{settings.kafka.connect_timeout_s:g}s ({reason}); {hint}"
    )


async def close_quietly(clients: Iterable[Any], timeout_s: float = 10.0) -> None:
    """Stop clients, logging (not raising) what fails: used on shutdown paths.

    A producer's stop waits for its pending records; with the broker gone that never ends, so each client
    gets ``timeout_s`` and is then abandoned with a warning (its undelivered records are lost to this
    process; callers only treat a record as sent once its send was acknowledged).
    """
    for client in clients:
        close = client.stop if hasattr(client, "stop") else client.close
        try:
            await asyncio.wait_for(close(), timeout_s)
        except TimeoutError:
            log.warning(
                "%s did not stop within %.0fs (broker unreachable?); abandoning it", type(client).__name__, timeout_s
            )
        except Exception:
            log.debug("closing %r failed", client, exc_info=True)
