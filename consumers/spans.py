"""The spans sink: OTLP protobuf records from the spans topic into the ``otel_traces`` table.

The records are ``ExportTraceServiceRequest`` bytes, exactly what the OTLP gateway publishes and what an
OpenTelemetry Collector's Kafka exporter writes with ``encoding: otlp_proto``. A record that is not valid
protobuf is poison (dead-lettered); duplicates from redelivery collapse on the table's (RolloutId, TraceId,
SpanId) key.

Two implementations of the flattening give the same rows: the native one (``native/otlp_rows``, Rust, about
four times faster, writing one ClickHouse Native block, columnar, which the engine takes in at a fraction of
RowBinary's parsing cost) when it is installed, else the pure-Python :class:`SpanColumns`
(Arrow), which is also the reference the tests hold the native one to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
from aiokafka.structs import ConsumerRecord
from google.protobuf.message import DecodeError as ProtobufDecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from fulmen.consumers.otlp_rows import SpanColumns
from fulmen.infra.store import EncodedRows
from fulmen.schemas import semconv
from fulmen.schemas.ddl import TABLES
from fulmen.schemas.errors import DecodeError
from fulmen.schemas.topics import TopicKey

__all__ = ["SpanSink", "native_flattener"]


def native_flattener() -> Any | None:
    """The native flattener built with our attribute keys, or None when the extension is not installed."""
    try:
        from fulmen.infra._otlp_rows import Flattener
    except ImportError:
        return None
    return Flattener(
        semconv.SERVICE_NAME,
        semconv.ROLLOUT_ID,
        semconv.ROLLOUT_ATTEMPT,
        semconv.MODEL_VERSION,
        semconv.PROMPT_TOKEN_IDS,
        semconv.RESPONSE_TOKEN_IDS,
        semconv.RESPONSE_LOGPROBS,
        semconv.TOKEN_ARRAY_INVALID,
        list(semconv.AGENT_NAME_KEYS),
        list(semconv.REWARD_KEYS),
    )


class SpanSink:
    """A :class:`fulmen.consumers.batch.Sink` for the spans topic. ``native=None`` uses the extension if present."""

    name = "spans"
    topic = TopicKey.SPANS
    table = TABLES["spans"]

    def __init__(self, native: bool | None = None) -> None:
        self.flattener = native_flattener() if native in (None, True) else None
        if native is True and self.flattener is None:
            raise ImportError("the native span flattener (fulmen.infra._otlp_rows) is not built: make install")
        self._native_columns = tuple(self.flattener.columns()) if self.flattener is not None else ()

    @property
    def native(self) -> bool:
        return self.flattener is not None

    def decode(self, record: ConsumerRecord) -> Any:
        where = {"topic": record.topic, "partition": record.partition, "offset": record.offset}
        if record.value is None:
            raise DecodeError("ExportTraceServiceRequest: the record has no value", **where)
        if self.flattener is not None:
            # Decoded once, in to_batch: a record that does not decode fails its batch, which the batch consumer
            # then converts record by record, dead-lettering this one with the DecodeError below.
            return record.value
        request = ExportTraceServiceRequest()
        try:
            request.ParseFromString(record.value)
        except ProtobufDecodeError as exc:
            raise DecodeError(f"ExportTraceServiceRequest: not valid OTLP protobuf ({exc})", **where) from None
        return request

    def to_batch(self, units: Sequence[Any]) -> pa.Table | EncodedRows:
        if self.flattener is not None:
            try:
                data, rows = self.flattener.flatten(list(units))
            except ValueError as exc:
                raise DecodeError(f"ExportTraceServiceRequest: not valid OTLP protobuf ({exc})") from None
            return EncodedRows(self._native_columns, data, rows, fmt="Native")
        columns = SpanColumns()
        for request in units:
            columns.add_request(request)
        return columns.to_table()
