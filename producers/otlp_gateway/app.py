"""``fulmen otlp-gateway``: an OTLP/HTTP trace receiver that publishes to the spans topic.

``POST /v1/traces`` takes ``application/x-protobuf`` or ``application/json`` bodies, gzip-compressed or not
(aiohttp inflates them before the handler sees them), splits them into one record per trace and answers 200
only after Kafka acknowledged every record (idempotent producer, ``acks=all``). Statuses follow the OTLP
specification:

* 200 with an ``ExportTraceServiceResponse``; ``partial_success`` counts spans that were refused (bad ids,
  a span over the record limit) while the rest went through;
* 400 undecodable body, 401 missing or wrong bearer token (when one is configured), 413 body too large,
  415 wrong content type;
* 503 with ``Retry-After`` when Kafka cannot take the data now: not connected yet, no acknowledgement in
  time, or more bytes in flight than ``max_inflight_bytes`` (the gateway never buffers without bound).

``GET /healthz`` answers while the process runs; ``GET /readyz`` only while the producer is connected.

Edges (``infra.http``): the bearer check is constant-time and an undecodable ``Authorization`` header is a 401;
a body whose ``Content-Length`` is over ``max_body_bytes`` is refused before it is read; headers, then the
body, must arrive within ``read_timeout_s``; a corrupt gzip body is a 400. Decoding, validating and splitting a
body run on a thread, so a large body does not stall the event loop (``/healthz`` keeps answering).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from google.rpc import status_pb2

from infra.errors import BrokerUnavailableError, PoisonInputError
from infra.http import bearer_auth_middleware, body_limit_middleware, read_body, server_options
from infra.kafka.clients import close_quietly, producer, start_or_raise
from producers.otlp_gateway.otlp import (
    Validated,
    decode_json,
    decode_protobuf,
    encode_response,
    split_by_trace,
    validate,
)
from producers.otlp_gateway.settings import OtlpGatewaySettings
from schemas.topics import TopicKey, topic_name

__all__ = ["GatewayStats", "OtlpGateway"]

log = logging.getLogger(__name__)

_PROTOBUF_TYPES = ("application/x-protobuf", "application/protobuf")
_JSON_TYPE = "application/json"


@dataclass
class GatewayStats:
    requests: int = 0
    spans_accepted: int = 0
    spans_rejected: int = 0
    records: int = 0
    unavailable: int = 0
    inflight_bytes: int = 0


class OtlpGateway:
    """The receiver. Build it, then :meth:`run` it (or :meth:`start`/:meth:`stop` it inside another loop)."""

    def __init__(self, settings: OtlpGatewaySettings, kafka_producer: AIOKafkaProducer | None = None) -> None:
        self.settings = settings
        self.options = settings.otlp
        self.topic = topic_name(TopicKey.SPANS, settings.kafka.topic_prefix)
        self.producer = kafka_producer or producer(settings, max_request_size=self.options.max_record_bytes + 65536)
        self.stats = GatewayStats()
        self.connected = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._connector: asyncio.Task[None] | None = None
        self.port: int | None = None
        self._cpu = ThreadPoolExecutor(2, thread_name_prefix="otlp-decode")

    # --- lifecycle ------------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        token = self.options.bearer_token.get_secret_value() if self.options.bearer_token else None
        app = web.Application(
            client_max_size=self.options.max_body_bytes,
            middlewares=[
                # Content-Length is the compressed size, so this refuses only what cannot fit inflated either.
                body_limit_middleware(self.options.max_body_bytes, respond=_guard_status),
                bearer_auth_middleware(token, open_paths=frozenset({"/healthz", "/readyz"}), respond=_guard_status),
            ],
        )
        app.router.add_post("/v1/traces", self.handle_traces)
        app.router.add_get("/healthz", self.handle_health)
        app.router.add_get("/readyz", self.handle_ready)
        return app

    async def start(self) -> None:
        """Listen, and connect the producer in the background (requests get 503 until it is connected)."""
        self._connector = asyncio.create_task(self._connect())
        self._runner = web.AppRunner(
            self.app(), access_log=None, handle_signals=False, **server_options(self.options.read_timeout_s)
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.options.host, self.options.port, backlog=1024)
        await site.start()
        sockets = site._server.sockets if site._server else []
        self.port = sockets[0].getsockname()[1] if sockets else self.options.port
        log.info(
            "OTLP gateway listening on http://%s:%d/v1/traces -> topic %s", self.options.host, self.port, self.topic
        )

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._connector is not None:
            self._connector.cancel()
        await close_quietly([self.producer])
        self._cpu.shutdown(wait=False, cancel_futures=True)

    async def run(self, stop: asyncio.Event) -> None:
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()

    async def _connect(self) -> None:
        delay = 0.5
        while True:
            try:
                await start_or_raise(self.producer, self.settings, "OTLP gateway producer")
            except BrokerUnavailableError as exc:
                log.warning("%s; retrying in %.0fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            self.connected.set()
            log.info("OTLP gateway connected to Kafka at %s", self.settings.bootstrap)
            return

    # --- handlers -------------------------------------------------------------------------------------------
    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def handle_ready(self, request: web.Request) -> web.Response:
        if self.connected.is_set():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="not connected to Kafka\n", headers={"Retry-After": "1"})

    async def handle_traces(self, request: web.Request) -> web.Response:
        self.stats.requests += 1
        content_type = request.content_type
        as_json = content_type == _JSON_TYPE
        if content_type not in _PROTOBUF_TYPES and not as_json:
            return _status(
                415,
                f"Content-Type must be application/x-protobuf or application/json, not {content_type or 'missing'}",
                as_json=True,
            )
        try:
            body = await read_body(
                request, max_bytes=self.options.max_body_bytes, timeout_s=self.options.read_timeout_s
            )
        except web.HTTPRequestEntityTooLarge:
            return _status(413, f"body larger than {self.options.max_body_bytes} bytes (after gzip inflation)", as_json)
        except web.HTTPException as exc:  # 408 too slow, 400 undecodable transfer (corrupt gzip)
            response = _status(exc.status, (exc.text or exc.reason).strip(), as_json)
            response.force_close()
            return response
        try:
            checked = await self._off_loop(_decode_and_validate, body, as_json, self.options.max_record_bytes - 1024)
        except PoisonInputError as exc:
            return _status(400, str(exc), as_json)
        if checked.accepted:
            failure = await self._publish(checked.request, len(body))
            if failure is not None:
                return failure
        self.stats.spans_accepted += checked.accepted
        self.stats.spans_rejected += checked.rejected
        payload = encode_response(checked.rejected, checked.error_message(), as_json=as_json)
        return web.Response(body=payload, content_type=_JSON_TYPE if as_json else _PROTOBUF_TYPES[0])

    async def _off_loop(self, function: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._cpu, function, *args)

    async def _publish(self, request: object, body_bytes: int) -> web.Response | None:
        """Send every record and wait for all acknowledgements; a 503 response when Kafka cannot take them."""
        if not self.connected.is_set():
            return self._unavailable("not connected to Kafka yet")
        if self.stats.inflight_bytes + body_bytes > self.options.max_inflight_bytes and self.stats.inflight_bytes:
            return self._unavailable(f"{self.stats.inflight_bytes} bytes already waiting for Kafka")
        records = await self._off_loop(split_by_trace, request, self.options.max_record_bytes)
        size = sum(len(r.value) for r in records)
        self.stats.inflight_bytes += size
        futures: list[asyncio.Future] = []
        try:
            async with asyncio.timeout(self.options.publish_timeout_s):
                for index, record in enumerate(records):
                    if index and not index % 256:
                        await asyncio.sleep(0)  # thousands of sends in a row would hold the event loop
                    future = await self.producer.send(self.topic, value=record.value, key=record.key)
                    future.add_done_callback(self._released(len(record.value)))
                    futures.append(future)
                await asyncio.gather(*futures)
        except (TimeoutError, KafkaError) as exc:
            self._release_unsent(size, futures, records)
            reason = "no acknowledgement in time" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            return self._unavailable(f"Kafka did not take the spans ({reason})")
        self.stats.records += len(records)
        return None

    def _released(self, size: int):
        def release(_: asyncio.Future) -> None:
            self.stats.inflight_bytes -= size

        return release

    def _release_unsent(self, total: int, futures: list, records: list) -> None:
        sent = sum(len(r.value) for r, _ in zip(records, futures, strict=False))
        self.stats.inflight_bytes -= total - sent  # records never handed to the producer

    def _unavailable(self, reason: str) -> web.Response:
        self.stats.unavailable += 1
        log.warning("OTLP gateway answering 503: %s", reason)
        retry = str(self.options.retry_after_s)
        return _status(503, reason, as_json=False, headers={"Retry-After": retry})


def _decode_and_validate(body: bytes, as_json: bool, max_span_bytes: int) -> Validated:
    """Decode and check a body (CPU work: runs on a thread); :class:`PoisonInputError` when undecodable."""
    decoded = decode_json(body) if as_json else decode_protobuf(body)
    return validate(decoded, max_span_bytes)


def _guard_status(request: web.Request, code: int, message: str, headers: dict[str, str]) -> web.Response:
    """The HTTP guards' answers (401, 413) in OTLP's shape."""
    return _status(code, message, request.content_type == _JSON_TYPE, headers)


def _status(code: int, message: str, as_json: bool, headers: dict[str, str] | None = None) -> web.Response:
    """An error response with a google.rpc.Status body, as OTLP/HTTP specifies."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate cannot be sent
    status = status_pb2.Status(code=_GRPC_CODES.get(code, 2), message=message)
    if as_json:
        from google.protobuf import json_format

        body, content_type = json_format.MessageToJson(status, indent=None).encode(), _JSON_TYPE
    else:
        body, content_type = status.SerializeToString(), _PROTOBUF_TYPES[0]
    return web.Response(status=code, body=body, content_type=content_type, headers=headers)


# HTTP status -> google.rpc.Code, for the Status body.
_GRPC_CODES = {400: 3, 401: 16, 408: 4, 413: 8, 415: 3, 503: 14}
