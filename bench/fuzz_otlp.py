"""Fuzz bodies for ``POST /v1/traces`` in protobuf: valid batches, odd field values, hand-written wire bytes
(invalid UTF-8, wrong wire types, nesting past the parser's limit), truncations and byte mutations."""

from __future__ import annotations

import random

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from bench.fuzz_inputs import mutate_bytes, random_bytes
from bench.otlp_payloads import make_request
from fulmen.schemas import semconv

__all__ = ["protobuf_body", "protobuf_variant"]


def protobuf_body(rng: random.Random, spans: int = 3) -> bytes:
    return make_request(spans, seed=rng.randrange(2**32), spans_per_trace=2).SerializeToString()


# --- wire format ---------------------------------------------------------------------------------------------
def varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def wrap_span(span: bytes) -> bytes:
    """A span's wire bytes inside ResourceSpans(1) > ScopeSpans(2) > Span(2): a whole request."""
    return field(1, field(2, field(2, span)))


def _span_fields(rng: random.Random) -> bytes:
    return field(1, rng.randbytes(16)) + field(2, rng.randbytes(8)) + field(5, b"chat")


def wire_trick(rng: random.Random) -> tuple[str, bytes]:
    base = _span_fields(rng)
    choices = {
        "invalid_utf8_name": lambda: wrap_span(
            field(1, rng.randbytes(16)) + field(2, rng.randbytes(8)) + field(5, b"\xff\xfe\xed\xa0\x80")
        ),
        "invalid_utf8_attr_key": lambda: wrap_span(
            base + field(9, field(1, b"\xed\xa0\x80") + field(2, field(1, b"v")))
        ),
        "invalid_utf8_attr_value": lambda: wrap_span(base + field(9, field(1, b"k") + field(2, field(1, b"\xc3\x28")))),
        "invalid_utf8_service": lambda: field(
            1, field(1, field(1, field(1, b"service.name") + field(2, field(1, b"\xff"))))
        ),
        "wrong_wire_type": lambda: varint(1 << 3 | 0) + varint(rng.randrange(2**64)),
        "fixed64_as_len": lambda: wrap_span(base + varint(7 << 3 | 2) + varint(8) + rng.randbytes(8)),
        "len_past_end": lambda: varint(1 << 3 | 2) + varint(2**31) + rng.randbytes(10),
        "len_huge_varint": lambda: varint(1 << 3 | 2) + b"\xff" * 10 + b"\x01",
        "group_wire_type": lambda: varint(1 << 3 | 3) + rng.randbytes(8) + varint(1 << 3 | 4),
        "field_zero": lambda: varint(0) + rng.randbytes(8),
        "unknown_fields": lambda: wrap_span(base) + field(rng.randrange(2, 2**29), rng.randbytes(32)),
        "kvlist_nested_200": lambda: wrap_span(base + field(9, field(1, b"k") + _nested_any(200))),
        "kvlist_nested_5000": lambda: wrap_span(base + field(9, field(1, b"k") + _nested_any(5000))),
        "ids_wrong_length": lambda: wrap_span(
            field(1, rng.randbytes(rng.choice([0, 1, 15, 17, 32])))
            + field(2, rng.randbytes(rng.choice([0, 1, 7, 9, 16])))
            + field(5, b"x")
        ),
        "ids_zero": lambda: wrap_span(field(1, b"\0" * 16) + field(2, b"\0" * 8) + field(5, b"x")),
        "repeated_spans_10000": lambda: field(1, field(2, b"".join(field(2, _span_fields(rng)) for _ in range(10000)))),
        "empty_resource_spans": lambda: field(1, b"") * rng.randint(1, 1000),
        "times_max": lambda: wrap_span(base + b"\x39" + b"\xff" * 8 + b"\x41" + b"\0" * 8),
        "kind_out_of_range": lambda: wrap_span(base + varint(6 << 3) + varint(rng.choice([99, 2**32, 2**64 - 1]))),
        "status_code_odd": lambda: wrap_span(base + field(15, varint(3 << 3) + varint(2**63))),
    }
    name = rng.choice(list(choices))
    return f"wire:{name}", choices[name]()


def _nested_any(depth: int) -> bytes:
    """AnyValue(kvlist_value(6) > KeyValueList.values(1) > KeyValue(key, value(2) > ...)) ``depth`` deep."""
    inner = field(1, b"leaf")  # string_value
    for _ in range(depth):
        inner = field(6, field(1, field(1, b"k") + field(2, inner)))
    return field(2, inner)


# --- typed edits ---------------------------------------------------------------------------------------------
def typed_edit(rng: random.Random) -> tuple[str, bytes]:
    request = make_request(rng.choice([1, 2, 5]), seed=rng.randrange(2**32), spans_per_trace=2)
    span = request.resource_spans[0].scope_spans[0].spans[0]
    edits = {
        "name_huge": lambda: setattr(span, "name", "n" * rng.choice([70_000, 1_100_000])),
        "name_empty": lambda: setattr(span, "name", ""),
        "name_surrogate_escaped": lambda: setattr(span, "name", "\\ud800"),
        "start_after_end": lambda: setattr(span, "start_time_unix_nano", span.end_time_unix_nano + 10**12),
        "times_zero": lambda: (setattr(span, "start_time_unix_nano", 0), setattr(span, "end_time_unix_nano", 0)),
        "attributes_many": lambda: [
            span.attributes.add(key=f"k{i}").value.CopyFrom(AnyValue(int_value=i))
            for i in range(rng.choice([1000, 20000]))
        ],
        "attribute_bytes_huge": lambda: span.attributes.add(key="b").value.CopyFrom(
            AnyValue(bytes_value=b"\0" * 2_000_000)
        ),
        "attribute_empty_value": lambda: span.attributes.add(key="empty"),
        "attribute_key_empty": lambda: span.attributes.add(key="").value.CopyFrom(AnyValue(string_value="v")),
        "attribute_reward_odd": lambda: _set(
            span, semconv.REWARD_VALUE, AnyValue(string_value=rng.choice(["nan", "inf", "x", "1e400"]))
        ),
        "attempt_odd": lambda: _set(
            span, semconv.ROLLOUT_ATTEMPT, AnyValue(int_value=rng.choice([-1, 0, 2**63 - 1, -(2**63)]))
        ),
        "rollout_id_odd": lambda: _set(
            span, semconv.ROLLOUT_ID, AnyValue(string_value=rng.choice(["", "a" * 10000, "\u0000", "../x"]))
        ),
        "token_ids_odd": lambda: _set(span, semconv.RESPONSE_TOKEN_IDS, AnyValue(string_value="[1, 2, x]")),
        "events_many": lambda: [span.events.add(name="e", time_unix_nano=i) for i in range(5000)],
        "links_bad_ids": lambda: span.links.add(trace_id=rng.randbytes(3), span_id=rng.randbytes(30)),
        "parent_is_self": lambda: setattr(span, "parent_span_id", span.span_id),
        "spans_many_traces": lambda: _many_traces(request, rng),
    }
    name = rng.choice(list(edits))
    edits[name]()
    return f"typed:{name}", request.SerializeToString()


def _set(span, key: str, value: AnyValue) -> None:
    span.attributes.add(key=key).value.CopyFrom(value)


def _many_traces(request: ExportTraceServiceRequest, rng: random.Random) -> None:
    spans = request.resource_spans[0].scope_spans[0].spans
    for _ in range(rng.choice([200, 1000])):
        span = spans.add(name="s", trace_id=rng.randbytes(16), span_id=rng.randbytes(8))
        span.start_time_unix_nano = span.end_time_unix_nano = 1


def protobuf_variant(rng: random.Random) -> tuple[str, bytes]:
    roll = rng.random()
    if roll < 0.3:
        return "pb_mutated", mutate_bytes(rng, protobuf_body(rng))
    if roll < 0.45:
        body = protobuf_body(rng)
        return "pb_truncated", body[: rng.randrange(len(body))]
    if roll < 0.7:
        return wire_trick(rng)
    if roll < 0.95:
        return typed_edit(rng)
    return "pb_random_bytes", random_bytes(rng)
