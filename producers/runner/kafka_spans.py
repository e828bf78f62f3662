"""The runner's span exporter that writes straight into the spans topic, without the OTLP gateway's HTTP hop.

An agent that runs inside the runner traces through the runner's tracer provider. With ``span_export = kafka``
(the default) that provider's batch processor hands its spans to :class:`KafkaSpanExporter`, which does what the
OTLP gateway does with an export: the spans are encoded once (OTLP protobuf, the SDK's encoder), cut into one
record per trace by the gateway's own :func:`~fulmen.producers.otlp_gateway.otlp.prepare` (keyed by trace id, at
most ``max_record_bytes`` a record; a span over the limit is refused and logged), and sent with the runner's
idempotent ``acks=all`` producer; the feedback of ``gen_ai.evaluation.result`` span events goes to the feedback
topic as the gateway sends it. The records are the gateway's, byte for byte in layout, so the consumers cannot
tell them apart.

Threads: the SDK calls :meth:`KafkaSpanExporter.export` on its worker thread or on the thread that flushes
(``CoalescedFlush`` flushes in a worker thread), never on the event loop. The export hands the sends to the
runner's event loop (librdkafka's producer sends them from the exporting thread itself) and blocks until Kafka
acknowledged every record, so a flush that returned means the spans are on the topic, which is what the
transitions consumer's offset barrier needs before a rollout's end is published. An export before :meth:`bind`
(no loop yet), after the loop stopped, or on the loop's own thread fails (logged) rather than block. Every failed
export is noted by rollout (``failures``, the runner's
``ExportFailures``): those rollouts end failed rather than be trained on with spans missing.

Agents in their own processes (``sync_isolation = process``) and providers the agent set up itself keep
exporting by OTLP to ``otlp_endpoint``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import CancelledError
from typing import TYPE_CHECKING

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from fulmen.producers.otlp_gateway.otlp import prepare
from fulmen.producers.runner.tracing import ExportFailures
from fulmen.schemas.errors import PoisonInputError

if TYPE_CHECKING:  # confluent-kafka is loaded only by a runner that uses it
    from fulmen.infra.kafka.rdkafka import RdkafkaProducer

__all__ = ["KafkaSpanExporter"]

log = logging.getLogger(__name__)

_RECORD_OVERHEAD = 1024  # room for the resource and scope around a span in its record (as the gateway keeps)


class KafkaSpanExporter(SpanExporter):
    """Exports to ``spans_topic`` through ``producer`` (started and stopped by its owner) on a bound loop."""

    def __init__(
        self,
        producer: AIOKafkaProducer | RdkafkaProducer,  # RdkafkaProducer only where FULMEN_KAFKA_CLIENT says so
        spans_topic: str,
        feedback_topic: str,
        *,
        max_record_bytes: int = 1024 * 1024,
        timeout_s: float = 30.0,
        failures: ExportFailures | None = None,
    ) -> None:
        if timeout_s <= 0 or max_record_bytes <= _RECORD_OVERHEAD:
            raise ValueError(f"timeout_s must be > 0 and max_record_bytes > {_RECORD_OVERHEAD}")
        self.producer = producer
        self.spans_topic = spans_topic
        self.feedback_topic = feedback_topic
        self.max_record_bytes = max_record_bytes
        self.timeout_s = timeout_s
        self.failures = failures or ExportFailures()
        self.records = 0  # records acknowledged
        self.spans = 0  # spans in them
        self.refused = 0  # spans refused (over the record limit)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._shut = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Send on ``loop`` (the runner's, where the producer was started); call it from that loop's thread."""
        self._loop, self._loop_thread = loop, threading.get_ident()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running() or threading.get_ident() == self._loop_thread:
            # after shutdown (the runner ended) quietly: its provider may outlive it in a process that runs more
            (log.debug if self._shut else log.warning)(
                "%d span(s) not exported: the runner's event loop is not there to send them", len(spans)
            )
            if not self._shut:
                self.failures.note(spans, "the runner's event loop was not there to send them")
            return SpanExportResult.FAILURE
        body = encode_spans(spans).SerializeToString()
        try:
            prepared = prepare(body, False, self.max_record_bytes - _RECORD_OVERHEAD, self.max_record_bytes)
        except PoisonInputError as exc:  # the SDK's own encoding: never expected
            log.error("%d span(s) not exported: %s", len(spans), exc)
            self.failures.note(spans, str(exc))
            return SpanExportResult.FAILURE
        if prepared.rejected:
            self.refused += prepared.rejected
            log.warning("%d span(s) refused: %s", prepared.rejected, prepared.error_message)
        records = [(self.spans_topic, key, value) for key, value in zip(prepared.keys, prepared.values, strict=True)]
        records += [
            (self.feedback_topic, key, value)
            for key, value in zip(prepared.feedback_keys, prepared.feedback_values, strict=True)
        ]
        if not records:
            return SpanExportResult.SUCCESS
        try:
            self._send_from_thread(records, loop)
        except (TimeoutError, KafkaError, RuntimeError, CancelledError) as exc:
            reason = "no acknowledgement in time" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            log.warning("%d span(s) not exported to %s: %s", prepared.accepted, self.spans_topic, reason)
            self.failures.note(spans, f"not written to {self.spans_topic}: {reason}")
            return SpanExportResult.FAILURE
        self.records += len(prepared.keys)
        self.spans += prepared.accepted
        return SpanExportResult.SUCCESS

    def _send_from_thread(self, records: list[tuple[str, bytes, bytes]], loop: asyncio.AbstractEventLoop) -> None:
        """Send and wait from the exporting thread: by librdkafka straight from here (it is thread-safe), else
        through the runner's loop, where the aiokafka producer lives."""
        send_many_blocking = getattr(self.producer, "send_many_blocking", None)  # librdkafka's: thread-safe
        if send_many_blocking is not None:
            send_many_blocking(records, self.timeout_s)
            return
        sent = asyncio.run_coroutine_threadsafe(self._send(records), loop)
        try:
            sent.result(timeout=self.timeout_s + 1.0)
        except BaseException:
            sent.cancel()
            raise

    async def _send(self, records: list[tuple[str, bytes, bytes]]) -> None:
        """Hand every record to the producer, then wait for every acknowledgement (bounded by ``timeout_s``)."""
        async with asyncio.timeout(self.timeout_s):
            handed = [await self.producer.send(topic, value=value, key=key) for topic, key, value in records]
            for future in handed:
                await future

    def shutdown(self) -> None:
        """Send nothing more (the runner is done with its producer)."""
        self._loop, self._shut = None, True

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True  # every export waits for its acknowledgements: nothing is left to flush
