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

Edges (``fulmen.infra.http``): the bearer check is constant-time and an undecodable ``Authorization`` header is a 401;
a body whose ``Content-Length`` is over ``max_body_bytes`` is refused before it is read; headers, then the
body, must arrive within ``read_timeout_s``; a corrupt, truncated or trailing-garbage gzip body is a 400 and one
that inflates past ``max_body_bytes`` a 413. Decoding, validating and splitting a body run on a thread, or for a
body of ``process_body_bytes`` and up in a worker process (``decode_processes``, see
:mod:`fulmen.producers.otlp_gateway.decoding`), so a large body does not stall the event loop (``/healthz`` keeps
answering). A decoding process that dies with the body is a 503 with ``Retry-After`` (a fresh pool takes the retry).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from dataclasses import dataclass

from aiohttp import web
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from google.rpc import status_pb2

from fulmen.infra.http import read_body
from fulmen.infra.kafka.clients import producer
from fulmen.producers.gateway import Gateway, GatewayStats
from fulmen.producers.metrics import OTLP_SPANS
from fulmen.producers.otlp_gateway.decoding import BodyDecoder, DecoderCrashedError
from fulmen.producers.otlp_gateway.otlp import Prepared, encode_response
from fulmen.producers.otlp_gateway.settings import OtlpGatewaySettings, OtlpSection
from fulmen.schemas.errors import PoisonInputError
from fulmen.schemas.topics import TopicKey, topic_name

__all__ = ["OtlpGateway", "OtlpGatewayStats"]

log = logging.getLogger(__name__)

_PROTOBUF_TYPES = ("application/x-protobuf", "application/protobuf")
# Work between two turns of the event loop while a large export is published (one aiokafka send costs ~150 us).
_SENDS_PER_TURN = 32
_ACKS_PER_TURN = 512
_JSON_TYPE = "application/json"


@dataclass
class OtlpGatewayStats(GatewayStats):
    """:class:`GatewayStats` (``requests``: exports received) plus the receiver's own counts."""

    spans_accepted: int = 0
    spans_rejected: int = 0  # refused one by one (partial_success)
    inflight_bytes: int = 0  # handed to the producer, not yet acknowledged


class OtlpGateway(Gateway):
    """The receiver. Build it, then :meth:`run` it (or :meth:`start`/:meth:`stop` it inside another loop).

    Lifecycle (:class:`~fulmen.producers.gateway.Gateway`): start freezes the heap (see :meth:`_setup`), listens
    at once and connects the producer in the background (requests get 503 until it is connected); stop closes
    the decoding processes after the producer and unfreezes the heap.
    """

    name = "OTLP gateway"
    metrics_label = "otlp"

    def __init__(self, settings: OtlpGatewaySettings, kafka_producer: AIOKafkaProducer | None = None) -> None:
        super().__init__(
            settings,
            settings.otlp,
            kafka_producer or producer(settings, max_request_size=settings.otlp.max_record_bytes + 65536),
            topic=topic_name(TopicKey.SPANS, settings.kafka.topic_prefix),
            respond=_guard_status,
            connect_in_background=True,
        )
        self.options: OtlpSection = settings.otlp  # the base knows only its ListenOptions
        self.feedback_topic = topic_name(TopicKey.FEEDBACK, settings.kafka.topic_prefix)
        self.stats = OtlpGatewayStats()
        self._heap_held = False
        self.decoder = BodyDecoder(
            max_span_bytes=self.options.max_record_bytes - 1024,
            max_record_bytes=self.options.max_record_bytes,
            processes=self.options.decode_processes,
            process_body_bytes=self.options.process_body_bytes,
        )

    # --- lifecycle hooks (the order is Gateway's) ---------------------------------------------------------------
    def _add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/traces", self.handle_traces)

    async def _setup(self) -> None:
        """Freeze the garbage collector's view of the heap (``gc.freeze``, process-wide, undone by :meth:`stop`).

        What is alive now (imported modules, settings, clients) lives as long as the gateway, and a full
        collection walking all of it held the event loop 150-800 ms whenever a large export's allocations set
        one off. Full collections now walk only what was allocated since.
        """
        if not self._heap_held:
            _FrozenHeap.hold()
            self._heap_held = True

    async def _teardown(self) -> None:
        self.decoder.close()
        if self._heap_held:
            _FrozenHeap.release()
            self._heap_held = False

    def _description(self) -> str:
        return f"{self.name} (OTLP/HTTP at /v1/traces)"

    # --- handlers -------------------------------------------------------------------------------------------
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
        refusal = self._refusal(len(body))  # known now: do not split what Kafka cannot take
        try:
            prepared = await self.decoder.prepare(body, as_json, split=refusal is None)
        except PoisonInputError as exc:
            return _status(400, str(exc), as_json)
        except DecoderCrashedError as exc:  # the next body gets a fresh pool: the exporter's retry goes through
            log.warning("OTLP gateway: %s", exc)
            return _status(503, f"{exc}; retry", as_json, {"Retry-After": "1"})
        if prepared.accepted:
            refusal = refusal or self._refusal(len(body))
            if refusal is not None:
                return self._unavailable(refusal)
            failure = await self._publish(prepared)
            if failure is not None:
                return failure
        self.stats.spans_accepted += prepared.accepted
        self.stats.spans_rejected += prepared.rejected
        if prepared.accepted and self.settings.metrics.enabled:
            OTLP_SPANS.labels("accepted").inc(prepared.accepted)
        if prepared.rejected and self.settings.metrics.enabled:
            OTLP_SPANS.labels("rejected").inc(prepared.rejected)
        payload = encode_response(prepared.rejected, prepared.error_message, as_json=as_json)
        return web.Response(body=payload, content_type=_JSON_TYPE if as_json else _PROTOBUF_TYPES[0])

    def _refusal(self, body_bytes: int) -> str | None:
        """Why Kafka cannot take a body of this size now (503), or None."""
        if not self.connected.is_set():
            return "not connected to Kafka yet"
        if self.stats.inflight_bytes + body_bytes > self.options.max_inflight_bytes and self.stats.inflight_bytes:
            return f"{self.stats.inflight_bytes} bytes already waiting for Kafka"
        return None

    async def _publish(self, prepared: Prepared) -> web.Response | None:
        """Send every record and wait for all acknowledgements; a 503 response when Kafka cannot take them.

        Acknowledgements are awaited one by one rather than gathered: a settled future is awaited without
        yielding, so a broker answer that settles thousands of records at once costs one wake-up here, not a
        callback per record in a single turn of the event loop (10,000 of those held it ~300 ms).
        """
        records = [(self.topic, key, value) for key, value in zip(prepared.keys, prepared.values, strict=True)]
        records += [
            (self.feedback_topic, key, value)  # what the spans' evaluation events rate (evaluations.py)
            for key, value in zip(prepared.feedback_keys, prepared.feedback_values, strict=True)
        ]
        sizes = [len(value) for _, _, value in records]
        self.stats.inflight_bytes += sum(sizes)
        handed: list[asyncio.Future] = []
        acked = 0
        try:
            async with asyncio.timeout(self.options.publish_timeout_s):
                for index, (topic, key, value) in enumerate(records):
                    if index and not index % _SENDS_PER_TURN:
                        await asyncio.sleep(0)  # thousands of sends in a row would hold the event loop
                    handed.append(await self.producer.send(topic, value=value, key=key))
                for future in handed:
                    if acked and not acked % _ACKS_PER_TURN:
                        await asyncio.sleep(0)
                    await future
                    self.stats.inflight_bytes -= sizes[acked]
                    acked += 1
        except (TimeoutError, KafkaError) as exc:
            self.stats.inflight_bytes -= sum(sizes[len(handed) :])  # never handed to the producer
            for future, size in zip(handed[acked:], sizes[acked:], strict=False):
                future.add_done_callback(self._released(size))  # still with the producer: counted until settled
            reason = "no acknowledgement in time" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            return self._unavailable(f"Kafka did not take the spans ({reason})")
        self.stats.records += len(sizes)
        return None

    def _released(self, size: int):
        def release(_: asyncio.Future) -> None:
            self.stats.inflight_bytes -= size

        return release

    def _unavailable(self, reason: str) -> web.Response:
        self.stats.unavailable += 1
        log.warning("OTLP gateway answering 503: %s", reason)
        retry = str(self.options.retry_after_s)
        return _status(503, reason, as_json=False, headers={"Retry-After": retry})


class _FrozenHeap:
    """``gc.freeze()`` while at least one gateway of this process runs; ``gc.unfreeze()`` after the last one
    stops, so what became garbage meanwhile is collected then (nothing leaks)."""

    holders = 0

    @classmethod
    def hold(cls) -> None:
        if cls.holders == 0:
            gc.freeze()
        cls.holders += 1

    @classmethod
    def release(cls) -> None:
        cls.holders = max(cls.holders - 1, 0)
        if cls.holders == 0:
            gc.unfreeze()


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
_GRPC_CODES = {400: 3, 401: 16, 408: 4, 413: 8, 415: 3, 500: 13, 503: 14}
