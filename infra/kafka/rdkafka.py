"""librdkafka's producer (confluent-kafka) behind the part of aiokafka's producer that Fulmen uses.

``FULMEN_KAFKA_CLIENT=librdkafka`` makes :func:`fulmen.infra.kafka.clients.producer` build this instead of an
``AIOKafkaProducer``: same guarantees (idempotent, ``acks=all``, the configured codec), same calls (``start``,
``send`` returning a future of the acknowledgement, ``flush``, ``stop``), same errors (aiokafka's
:class:`~aiokafka.errors.KafkaError` family), so callers do not change. The protocol work (batching, compression,
requests, retries) runs in librdkafka's own C threads instead of on the event loop; the loop itself polls for
acknowledgements while records are in flight (a thread handing them over cost more than it saved).

A thread that is not the loop's can also send and wait without the loop (:meth:`RdkafkaProducer.send_many_blocking`):
the runner's span exporter runs in the OpenTelemetry SDK's thread and writes from there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from aiokafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError
from aiokafka.structs import RecordMetadata, TopicPartition
from confluent_kafka import KafkaError as RdError
from confluent_kafka import KafkaException, Message, Producer

__all__ = ["RdkafkaProducer", "rdkafka_config"]

log = logging.getLogger(__name__)
_LIBRDKAFKA_LOG = logging.getLogger("fulmen.librdkafka")  # librdkafka's own log lines (else on stderr)

# aiokafka's producer options that Fulmen passes (clients.producer and its callers' overrides), as librdkafka names
# them. Anything else is refused: a silently ignored option would be a guarantee that does not hold.
_OPTIONS = {
    "client_id": "client.id",
    "request_timeout_ms": "request.timeout.ms",
    "linger_ms": "linger.ms",
    "max_batch_size": "batch.size",
    "max_request_size": "message.max.bytes",
    "compression_type": "compression.type",
    "security_protocol": "security.protocol",
    "sasl_mechanism": "sasl.mechanism",
    "sasl_plain_username": "sasl.username",
    "sasl_plain_password": "sasl.password",
}
_SSL_FILES = {
    "ssl_cafile": "ssl.ca.location",
    "ssl_certfile": "ssl.certificate.location",
    "ssl_keyfile": "ssl.key.location",
}
_POLL_S = 0.1  # a metadata request's try while starting
_SPIN_S = 0.0005  # while records are in flight, the loop polls for their acknowledgements this often


def rdkafka_config(kwargs: dict[str, Any]) -> dict[str, Any]:
    """librdkafka's configuration for aiokafka-style producer ``kwargs`` (bootstrap, the options above, the SSL
    files by path); idempotence and ``acks=all`` are always on."""
    kwargs = dict(kwargs)
    if kwargs.pop("acks", "all") not in ("all", -1):
        raise ValueError("Fulmen's producers acknowledge with acks=all")
    if kwargs.pop("enable_idempotence", True) is not True:
        raise ValueError("Fulmen's producers are idempotent")
    kwargs.pop("ssl_context", None)  # librdkafka reads the files themselves (ssl_* below)
    servers = kwargs.pop("bootstrap_servers")
    config: dict[str, Any] = {
        "bootstrap.servers": servers if isinstance(servers, str) else ",".join(servers),
        "enable.idempotence": True,
        "acks": "all",
        "message.timeout.ms": 0,  # as aiokafka: retried until the caller gives up on it (its own timeout)
    }
    for name, value in kwargs.items():
        option = _OPTIONS.get(name) or _SSL_FILES.get(name)
        if option is None:
            raise ValueError(f"the librdkafka producer does not take {name!r}")
        if value is not None:
            config[option] = str(value) if name in _SSL_FILES else value
    if "batch.size" in config and "message.max.bytes" in config:
        config["batch.size"] = min(config["batch.size"], config["message.max.bytes"])
    return config


class RdkafkaProducer:
    """An idempotent ``acks=all`` producer on librdkafka with aiokafka's producer calls.

    Lifecycle: build, :meth:`start` (checks a broker answers), send, :meth:`stop` (waits for what is in flight).
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self._producer: Producer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Create the client and wait until a broker answers a metadata request; raises
        :class:`~aiokafka.errors.KafkaConnectionError` when none does within ``request.timeout.ms``."""
        self._loop = asyncio.get_running_loop()
        self._producer = Producer({**self.config, "error_cb": self._client_error, "logger": _LIBRDKAFKA_LOG})
        deadline = time.monotonic() + self.config.get("request.timeout.ms", 30_000) / 1000
        while True:  # short tries: a caller that stops waiting (start_or_raise's timeout) leaves no long call behind
            try:
                await asyncio.to_thread(self._producer.list_topics, timeout=_POLL_S * 5)
                break
            except KafkaException as exc:
                if time.monotonic() > deadline:
                    servers = self.config["bootstrap.servers"]
                    raise KafkaConnectionError(f"no broker answered at {servers}: {exc}") from None

    async def send(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        partition: int | None = None,
        headers: Sequence[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[RecordMetadata]:
        """Queue one record; the future settles with the broker's acknowledgement (or aiokafka's error)."""
        loop = self._loop
        if loop is None or self._producer is None:
            raise KafkaConnectionError("the producer is not started")
        future: asyncio.Future[RecordMetadata] = loop.create_future()
        await self._produce(topic, value, key, partition, headers, future)
        self._kick()
        return future

    async def send_and_wait(self, topic: str, value: bytes | None = None, key: bytes | None = None, **kw: Any) -> Any:
        return await (await self.send(topic, value, key, **kw))

    def send_many_blocking(self, records: Iterable[tuple[str, bytes, bytes]], timeout_s: float) -> int:
        """From a thread that is not the loop's: queue ``(topic, key, value)`` records and wait for all their
        acknowledgements. Returns how many; raises :class:`KafkaTimeoutError` when some are unacknowledged after
        ``timeout_s`` (they may still land) or the first delivery error."""
        if self._producer is None:
            raise KafkaConnectionError("the producer is not started")
        futures: list[concurrent.futures.Future[RecordMetadata]] = []
        deadline = time.monotonic() + timeout_s
        for topic, key, value in records:
            future: concurrent.futures.Future[RecordMetadata] = concurrent.futures.Future()
            self._produce_blocking(topic, value, key, future, deadline)
            futures.append(future)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._kick)  # the loop serves the acknowledgements
        _, pending = concurrent.futures.wait(futures, timeout=max(0.0, deadline - time.monotonic()))
        if pending:
            raise KafkaTimeoutError(f"{len(pending)} of {len(futures)} record(s) unacknowledged after {timeout_s:g}s")
        for future in futures:
            future.result()
        return len(futures)

    async def flush(self) -> None:
        """Wait until every queued record is acknowledged or failed."""
        while self._producer is not None and len(self._producer) > 0:
            self._kick()
            await asyncio.sleep(_SPIN_S * 10)

    async def stop(self) -> None:
        """Wait for what is in flight, then stop polling (callers bound this: see ``close_quietly``)."""
        if self._producer is None:
            return
        try:
            await self.flush()
        finally:
            if self._poller is not None:
                self._poller.cancel()
            self._producer = None

    # --- internals ------------------------------------------------------------------------------------------
    async def _produce(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        partition: int | None,
        headers: Sequence[tuple[str, bytes]] | None,
        future: Any,
    ) -> None:
        assert self._producer is not None
        options: dict[str, Any] = {"on_delivery": lambda err, msg: self._delivered(future, err, msg)}
        if partition is not None:
            options["partition"] = partition
        if headers:
            options["headers"] = list(headers)
        while True:
            try:
                self._producer.produce(topic, value, key, **options)
                return
            except BufferError:  # the local queue is full: serve acknowledgements to make room
                self._kick()
                await asyncio.sleep(0.005)
            except KafkaException as exc:
                raise _aiokafka_error(exc.args[0]) from None

    def _produce_blocking(
        self, topic: str, value: bytes, key: bytes, future: concurrent.futures.Future[Any], deadline: float
    ) -> None:
        assert self._producer is not None
        while True:
            try:
                self._producer.produce(
                    topic, value, key, on_delivery=lambda err, msg: self._delivered(future, err, msg)
                )
                return
            except BufferError:  # the queue is full: the loop serves acknowledgements to make room
                if time.monotonic() > deadline:
                    raise KafkaTimeoutError("the producer's queue stayed full") from None
                if self._loop is not None:
                    self._loop.call_soon_threadsafe(self._kick)
                time.sleep(0.005)
            except KafkaException as exc:
                raise _aiokafka_error(exc.args[0]) from None

    def _delivered(self, future: Any, err: RdError | None, msg: Message | None) -> None:
        """librdkafka's delivery report, served on the loop by :meth:`_drain`."""
        if future.done():
            return
        if err is None:
            future.set_result(_metadata(msg))
        else:
            future.set_exception(_aiokafka_error(err))

    def _kick(self) -> None:
        """On the loop: make sure something serves acknowledgements while records are in flight."""
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._drain(), name="rdkafka-acks")

    async def _drain(self) -> None:
        """Serve delivery reports on the loop (no thread hands them over) for as long as records are in flight:
        a poll that served none waits a short spin before the next."""
        while (producer := self._producer) is not None and len(producer) > 0:
            await asyncio.sleep(0 if producer.poll(0) else _SPIN_S)

    def _client_error(self, err: RdError) -> None:
        level = logging.ERROR if err.fatal() else logging.DEBUG  # transport errors are retried by librdkafka
        log.log(level, "librdkafka: %s", err)


def _metadata(msg: Message | None) -> RecordMetadata:
    assert msg is not None
    topic, partition = msg.topic() or "", msg.partition() or 0
    timestamp_type, timestamp = msg.timestamp()
    where = TopicPartition(topic, partition)
    return RecordMetadata(topic, partition, where, msg.offset(), timestamp, timestamp_type, -1)


def _aiokafka_error(err: RdError) -> KafkaError:
    if err.code() == RdError._MSG_TIMED_OUT:
        return KafkaTimeoutError(str(err))
    if err.code() in (RdError._TRANSPORT, RdError._ALL_BROKERS_DOWN):
        return KafkaConnectionError(str(err))
    return KafkaError(f"{err.name()}: {err.str()}")
