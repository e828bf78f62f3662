"""The dead-letters sink: a row per parked record, and never a dead letter of its own."""

from __future__ import annotations

from aiokafka.structs import ConsumerRecord

from fulmen.consumers.dead_letters import PREVIEW_BYTES, DeadLetterSink
from fulmen.schemas import DeadLetterHeaders


def record(value: bytes | None, headers: list[tuple[str, bytes]], offset: int = 5) -> ConsumerRecord:
    return ConsumerRecord("p.fulmen.dlq", 0, offset, 1_700_000_000_000, 0, b"k\xff", value, None, 0, 0, headers)


def test_a_dead_letter_becomes_a_row_with_where_and_why() -> None:
    headers = DeadLetterHeaders(
        source_topic="p.otlp_spans",
        source_partition=2,
        source_offset=41,
        error_type="DecodeError",
        error="not valid OTLP protobuf",
        consumer_group="g.spans",
    )
    sink = DeadLetterSink()
    [row] = sink.to_batch([sink.decode(record(b"\x00" * (PREVIEW_BYTES + 10), headers.to_kafka()))]).to_pylist()
    assert (row["Topic"], row["Partition"], row["Offset"]) == ("p.fulmen.dlq", 0, 5)
    assert (row["SourceTopic"], row["SourcePartition"], row["SourceOffset"]) == ("p.otlp_spans", 2, 41)
    assert (row["ErrorType"], row["Error"], row["ConsumerGroup"]) == (
        "DecodeError",
        "not valid OTLP protobuf",
        "g.spans",
    )
    assert row["Key"] == "k\\xff"  # bytes that are not UTF-8 are shown escaped
    assert row["ValueBytes"] == PREVIEW_BYTES + 10 and len(row["ValuePreview"]) == PREVIEW_BYTES
    assert row["FailedAt"] == headers.failed_at


def test_a_record_without_our_headers_is_stored_not_dead_lettered() -> None:
    sink = DeadLetterSink()
    for headers in ([], [("fulmen.dlq.source_topic", b"x")], [("fulmen.dlq.source_partition", b"\xff")]):
        [row] = sink.to_batch([sink.decode(record(None, headers))]).to_pylist()
        assert row["ErrorType"] == "unknown" and "headers are missing or invalid" in row["Error"]
        assert (row["SourcePartition"], row["ValueBytes"], row["ValuePreview"]) == (-1, 0, "")
