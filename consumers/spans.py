"""The spans sink: OTLP protobuf records from the spans topic into the ``otel_traces`` table.

The records are ``ExportTraceServiceRequest`` bytes, exactly what the OTLP gateway publishes and what an
OpenTelemetry Collector's Kafka exporter writes with ``encoding: otlp_proto``. A record that is not valid
protobuf is poison (dead-lettered); duplicates from redelivery collapse on the table's (RolloutId, TraceId,
SpanId) key.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
from aiokafka.structs import ConsumerRecord
from google.protobuf.message import DecodeError as ProtobufDecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from consumers.otlp_rows import SpanColumns
from infra.errors import DecodeError
from schemas.ddl import TABLES
from schemas.topics import TopicKey

__all__ = ["SpanSink"]


class SpanSink:
    """A :class:`consumers.batch.Sink` for the spans topic."""

    name = "spans"
    topic = TopicKey.SPANS
    table = TABLES["spans"]

    def decode(self, record: ConsumerRecord) -> ExportTraceServiceRequest:
        where = {"topic": record.topic, "partition": record.partition, "offset": record.offset}
        if record.value is None:
            raise DecodeError("ExportTraceServiceRequest: the record has no value", **where)
        request = ExportTraceServiceRequest()
        try:
            request.ParseFromString(record.value)
        except ProtobufDecodeError as exc:
            raise DecodeError(f"ExportTraceServiceRequest: not valid OTLP protobuf ({exc})", **where) from None
        return request

    def to_arrow(self, units: Sequence[ExportTraceServiceRequest]) -> pa.Table:
        columns = SpanColumns()
        for request in units:
            columns.add_request(request)
        return columns.to_table()
