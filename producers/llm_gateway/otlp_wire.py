"""The OTLP messages the LLM gateway writes, in protobuf's wire format, without protobuf's message objects.

A call's span carries its prompt and response token ids as OTLP arrays, one ``AnyValue`` message per id. Built as
message objects (a ``KeyValue`` and an ``AnyValue`` per attribute, one more per array element) that was the largest
share of the gateway's own CPU per call; written here as bytes it is a few joins. The bytes are what protobuf's
serializer writes for the same message (fields in number order, proto3 defaults left out, a ``oneof`` member written
even when zero): ``tests/unit/test_otlp_wire.py`` holds them to it, and the spans consumer parses them as it parses any
exporter's. Only what the gateway writes is here: an ``ExportTraceServiceRequest`` of one resource and one scope,
spans with attributes and a status (no events, links or flags).

Field numbers (``opentelemetry/proto``): ``ExportTraceServiceRequest.resource_spans`` 1; ``ResourceSpans.resource``
1, ``scope_spans`` 2; ``Resource.attributes`` 1; ``ScopeSpans.scope`` 1, ``spans`` 2; ``InstrumentationScope.name``
1; ``Span.trace_id`` 1, ``span_id`` 2, ``parent_span_id`` 4, ``name`` 5, ``kind`` 6, ``start_time_unix_nano`` 7
(fixed64), ``end_time_unix_nano`` 8 (fixed64), ``attributes`` 9, ``status`` 15; ``Status.code`` 3; ``KeyValue.key`` 1,
``value`` 2; ``AnyValue.string_value`` 1, ``bool_value`` 2, ``int_value`` 3 (int64), ``double_value`` 4,
``array_value`` 5; ``ArrayValue.values`` 1.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["SPAN_KIND_SERVER", "STATUS_CODE_OK", "export_request", "resource_bytes", "scope_bytes", "span_bytes"]

SPAN_KIND_SERVER = 2
STATUS_CODE_OK = 1

_INT64 = (-(1 << 63), (1 << 63) - 1)
_SMALL = [bytes([n]) for n in range(128)]
_FIXED64 = struct.Struct("<Q")
_DOUBLE = struct.Struct("<d")
_CACHED_INTS = 1 << 17  # token ids below this keep their encoded array element (bounded: at most 131,072 of them)
_int_elements: dict[int, bytes] = {}


def varint(value: int) -> bytes:
    """A base-128 varint; a negative value as its 64-bit two's complement (int64's ten bytes)."""
    if 0 <= value < 128:
        return _SMALL[value]
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, its length, its bytes."""
    return tag + varint(len(payload)) + payload


def any_value(value: Any) -> bytes:
    """An ``AnyValue``'s bytes: bool, int (int64; beyond it, as text), float, list or tuple (an array), else text."""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + varint(value) if _INT64[0] <= value <= _INT64[1] else _field(b"\x0a", str(value).encode())
    if isinstance(value, float):
        return b"\x21" + _DOUBLE.pack(value)
    if isinstance(value, (list, tuple)):
        return _field(b"\x2a", b"".join([_element(item) for item in value]))
    return _field(b"\x0a", str(value).encode())


def _element(item: Any) -> bytes:
    """One element of an ``ArrayValue`` (its field 1): token ids and logprobs take the short paths."""
    if type(item) is int and 0 <= item < _CACHED_INTS:
        found = _int_elements.get(item)
        if found is None:
            found = _int_elements[item] = _field(b"\x0a", b"\x18" + varint(item))
        return found
    if type(item) is float:
        return b"\x0a\x09\x21" + _DOUBLE.pack(item)
    return _field(b"\x0a", any_value(item))


def key_values(attributes: Mapping[str, Any], tag: bytes) -> bytes:
    """Each attribute as a ``KeyValue`` in the repeated field ``tag``, in the mapping's order."""
    return b"".join(
        [_field(tag, _field(b"\x0a", key.encode()) + _field(b"\x12", any_value(v))) for key, v in attributes.items()]
    )


def resource_bytes(attributes: Mapping[str, Any]) -> bytes:
    """``ResourceSpans.resource`` (field 1) with these attributes."""
    return _field(b"\x0a", key_values(attributes, b"\x0a"))


def scope_bytes(name: str) -> bytes:
    """``ScopeSpans.scope`` (field 1) named ``name``."""
    return _field(b"\x0a", _field(b"\x0a", name.encode()) if name else b"")


def span_bytes(
    *,
    trace_id: bytes,
    span_id: bytes,
    parent_span_id: bytes,
    name: str,
    kind: int,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, Any],
    status_code: int,
) -> bytes:
    """One ``Span``'s bytes (proto3: empty and zero fields are left out)."""
    parts = [_field(b"\x0a", trace_id), _field(b"\x12", span_id)]
    if parent_span_id:
        parts.append(_field(b"\x22", parent_span_id))
    if name:
        parts.append(_field(b"\x2a", name.encode()))
    if kind:
        parts.append(b"\x30" + varint(kind))
    if start_ns:
        parts.append(b"\x39" + _FIXED64.pack(start_ns))
    if end_ns:
        parts.append(b"\x41" + _FIXED64.pack(end_ns))
    parts.append(key_values(attributes, b"\x4a"))
    if status_code:
        parts.append(_field(b"\x7a", b"\x18" + varint(status_code)))
    return b"".join(parts)


def export_request(resource: bytes, scope: bytes, spans: Iterable[bytes]) -> bytes:
    """An ``ExportTraceServiceRequest`` of one resource (:func:`resource_bytes`) and one scope (:func:`scope_bytes`)
    holding ``spans`` (:func:`span_bytes`)."""
    scope_spans = scope + b"".join([_field(b"\x12", span) for span in spans])
    return _field(b"\x0a", resource + _field(b"\x12", scope_spans))
