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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from aiokafka.structs import TopicPartition

    from fulmen.consumers.transitions.feed import SpanFeed

__all__ = ["SpanBlock", "SpanSink", "native_flattener"]


@dataclass(frozen=True)
class SpanBlock(EncodedRows):
    """A Native block of spans, with the records of its wanted rollouts' spans for the span feed (``records``) and
    the other stamped rollout attempts it holds spans of (``skipped``)."""

    records: list[Any] = field(default_factory=list)
    skipped: list[tuple[str, int]] = field(default_factory=list)


def native_flattener() -> Any | None:
    """The native flattener built with our attribute keys, or None when the extension is not installed."""
    from fulmen.consumers.transitions.feed import RECORD_ATTRIBUTES, RECORD_EVENT_ATTRIBUTES

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
        list(RECORD_ATTRIBUTES),
        list(RECORD_EVENT_ATTRIBUTES),
    )


class SpanSink:
    """A :class:`fulmen.consumers.batch.Sink` for the spans topic. ``native=None`` uses the extension if present.
    With a ``feed`` (and the native flattener), each stored batch's stamped spans go to the transitions consumer's
    :class:`~fulmen.consumers.transitions.feed.SpanFeed` too."""

    name = "spans"
    topic = TopicKey.SPANS
    table = TABLES["spans"]

    def __init__(self, native: bool | None = None, feed: SpanFeed | None = None) -> None:
        self.flattener = native_flattener() if native in (None, True) else None
        if native is True and self.flattener is None:
            raise ImportError("the native span flattener (fulmen.infra._otlp_rows) is not built: make install")
        self._native_columns = tuple(self.flattener.columns()) if self.flattener is not None else ()
        self.feed = feed if self.flattener is not None else None  # the Python path makes no records

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
                if self.feed is None or not self.feed.covering:
                    data, rows = self.flattener.flatten(list(units))
                    return EncodedRows(self._native_columns, data, rows, fmt="Native")
                # while rollouts run, every stamped span (a span may come before its claim is read); else none
                wanted = None if self.feed.wanted else set()
                data, rows, records, skipped = self.flattener.flatten_records(list(units), wanted)
            except ValueError as exc:
                raise DecodeError(f"ExportTraceServiceRequest: not valid OTLP protobuf ({exc})") from None
            return SpanBlock(self._native_columns, data, rows, fmt="Native", records=records, skipped=skipped)
        columns = SpanColumns()
        for request in units:
            columns.add_request(request)
        return columns.to_table()

    # --- the span feed (optional hooks of a Sink: fulmen.consumers.batch) ---------------------------------------
    def stored(self, batch: pa.Table | EncodedRows) -> None:
        """The store took ``batch`` (its offsets are not committed yet): its stamped spans go to the feed."""
        if self.feed is not None and isinstance(batch, SpanBlock):
            self.feed.add(batch.records, batch.skipped)

    def assigned(self, partitions: list[TopicPartition]) -> None:
        if self.feed is not None:
            self.feed.assigned(partitions)

    def revoked(self, partitions: list[TopicPartition]) -> None:
        if self.feed is not None:
            self.feed.revoked(partitions)
