"""The dead-letters sink: the dead-letter topic's records into the ``dead_letters`` table, for people to read.

Each record keeps its original key and value; its headers (:class:`~fulmen.schemas.events.DeadLetterHeaders`)
say where it came from and why it was parked. A row holds those, the record's place in the dead-letter topic
(the table's key, so a redelivered record replaces itself) and a preview of its bytes; the topic itself keeps
the whole record for replay.

This sink never dead-letters (that would feed its own topic): a record whose headers are missing or not ours
is stored with ``ErrorType`` ``unknown`` and the header problem as its error.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
from aiokafka.structs import ConsumerRecord
from pydantic import ValidationError

from fulmen.schemas.ddl import TABLES
from fulmen.schemas.events import DeadLetterHeaders
from fulmen.schemas.topics import TopicKey

__all__ = ["DEAD_LETTER_SCHEMA", "DeadLetterSink", "dead_letter_row"]

PREVIEW_BYTES = 4096  # of the value shown; the topic keeps the rest

_TS6 = pa.timestamp("us", tz="UTC")
DEAD_LETTER_SCHEMA = pa.schema(
    [
        ("Topic", pa.string()),
        ("Partition", pa.uint32()),
        ("Offset", pa.uint64()),
        ("SourceTopic", pa.string()),
        ("SourcePartition", pa.int32()),
        ("SourceOffset", pa.int64()),
        ("ErrorType", pa.string()),
        ("Error", pa.string()),
        ("ConsumerGroup", pa.string()),
        ("FailedAt", _TS6),
        ("Key", pa.string()),
        ("ValuePreview", pa.string()),
        ("ValueBytes", pa.uint64()),
        ("Timestamp", pa.timestamp("ms", tz="UTC")),
    ]
)


def _text(data: bytes | None, limit: int) -> str:
    """Bytes as text for a person: UTF-8 where it is, escapes where it is not, cut at ``limit`` bytes."""
    return (data or b"")[:limit].decode("utf-8", "backslashreplace")


def dead_letter_row(record: ConsumerRecord) -> dict[str, Any]:
    """One row for one dead-letter record (never raises for what the record holds)."""
    written = datetime.fromtimestamp(max(record.timestamp, 0) / 1000, UTC)
    try:
        headers = DeadLetterHeaders.from_kafka(list(record.headers or ()))
        where: dict[str, Any] = {
            "SourceTopic": headers.source_topic,
            "SourcePartition": headers.source_partition,
            "SourceOffset": headers.source_offset,
            "ErrorType": headers.error_type,
            "Error": headers.error,
            "ConsumerGroup": headers.consumer_group,
            "FailedAt": headers.failed_at,
        }
    except (ValidationError, UnicodeDecodeError, ValueError) as exc:
        where = {
            "SourceTopic": "",
            "SourcePartition": -1,
            "SourceOffset": -1,
            "ErrorType": "unknown",
            "Error": f"the record's dead-letter headers are missing or invalid: {str(exc)[:500]}",
            "ConsumerGroup": "",
            "FailedAt": written,
        }
    return {
        "Topic": record.topic,
        "Partition": record.partition,
        "Offset": record.offset,
        **where,
        "Key": _text(record.key, 512),
        "ValuePreview": _text(record.value, PREVIEW_BYTES),
        "ValueBytes": len(record.value or b""),
        "Timestamp": written,
    }


class DeadLetterSink:
    """A :class:`fulmen.consumers.batch.Sink` for the dead-letter topic (its ``decode`` never raises)."""

    name = "dead_letters"
    topic = TopicKey.DLQ
    table = TABLES["dead_letters"]

    def decode(self, record: ConsumerRecord) -> dict[str, Any]:
        return dead_letter_row(record)

    def to_batch(self, units: Sequence[dict[str, Any]]) -> pa.Table:
        return pa.Table.from_pylist(list(units), schema=DEAD_LETTER_SCHEMA)
