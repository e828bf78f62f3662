"""The LLM gateway's OTLP wire encoding gives protobuf's own bytes for the same message."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from fulmen.producers.llm_gateway.otlp_wire import (
    SPAN_KIND_SERVER,
    STATUS_CODE_OK,
    export_request,
    resource_bytes,
    scope_bytes,
    span_bytes,
    varint,
)
from tests.integration.transition_pipeline import any_value

ATTRIBUTES: dict[str, Any] = {
    "gen_ai.operation.name": "chat",
    "gen_ai.input.messages": '[{"role": "user", "content": "héllo ✓"}]',
    "gen_ai.usage.input_tokens": 0,
    "small": 127,
    "two_bytes": 128,
    "big": 2**40 + 7,
    "negative": -3,
    "int64_min": -(2**63),
    "flag": True,
    "off": False,
    "temperature": 0.7,
    "minus": -1.5e-300,
    "fulmen.prompt.token_ids": [1, 0, 127, 128, 49151, 131071, 131072, 2**33],
    "fulmen.response.logprobs": [-0.25, 0.0, -12.5],
    "stop": ["\n", "END"],
    "mixed": (1, "a", 2.5, True),
    "empty": [],
}


def reference(attributes: dict[str, Any], parent: bytes) -> bytes:
    """What protobuf's message objects serialize for the same request."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.append(KeyValue(key="service.name", value=any_value("gw")))
    scope_spans = resource_spans.scope_spans.add()
    scope_spans.scope.name = "fulmen.llm_gateway"
    for index in range(2):
        span = Span(
            trace_id=bytes(range(16)),
            span_id=bytes([index + 1] * 8),
            parent_span_id=parent,
            name="chat fulmen",
            kind=Span.SpanKind.SPAN_KIND_SERVER,
            start_time_unix_nano=1_700_000_000_000_000_000,
            end_time_unix_nano=1_700_000_000_123_456_789,
            status=Status(code=Status.StatusCode.STATUS_CODE_OK),
        )
        span.attributes.extend(KeyValue(key=k, value=any_value(v)) for k, v in attributes.items())
        scope_spans.spans.append(span)
    return request.SerializeToString()


def written(attributes: dict[str, Any], parent: bytes) -> bytes:
    spans = [
        span_bytes(
            trace_id=bytes(range(16)),
            span_id=bytes([index + 1] * 8),
            parent_span_id=parent,
            name="chat fulmen",
            kind=SPAN_KIND_SERVER,
            start_ns=1_700_000_000_000_000_000,
            end_ns=1_700_000_000_123_456_789,
            attributes=attributes,
            status_code=STATUS_CODE_OK,
        )
        for index in range(2)
    ]
    return export_request(resource_bytes({"service.name": "gw"}), scope_bytes("fulmen.llm_gateway"), spans)


@pytest.mark.parametrize("parent", [b"", bytes(range(8, 16))])
def test_the_bytes_are_protobufs_own(parent: bytes) -> None:
    assert written(ATTRIBUTES, parent) == reference(ATTRIBUTES, parent)
    assert ExportTraceServiceRequest.FromString(written(ATTRIBUTES, parent)) == ExportTraceServiceRequest.FromString(
        reference(ATTRIBUTES, parent)
    )


def test_a_long_call_and_varints_at_their_edges() -> None:
    long_call = {"fulmen.prompt.token_ids": list(range(0, 200_000, 7)), "fulmen.response.logprobs": [-0.1] * 300}
    assert written(long_call, b"") == reference(long_call, b"")
    assert [varint(n) for n in (0, 127, 128, 300)] == [b"\x00", b"\x7f", b"\x80\x01", b"\xac\x02"]
    assert varint(-1) == b"\xff" * 9 + b"\x01"  # int64 -1: ten bytes


def test_an_int_beyond_int64_is_kept_as_text_rather_than_failing_the_call() -> None:
    request = ExportTraceServiceRequest.FromString(written({"seed": 2**64 + 1}, b""))
    value = request.resource_spans[0].scope_spans[0].spans[0].attributes[0].value
    assert value.string_value == str(2**64 + 1)
