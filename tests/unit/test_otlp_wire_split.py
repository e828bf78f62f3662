"""The OTLP gateway's native split on the wire bytes gives what the reference (validate + split_by_trace) gives."""

from __future__ import annotations

import random

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench.fuzz_otlp import field, protobuf_variant, wrap_span
from bench.otlp_payloads import make_request
from fulmen.producers.otlp_gateway import otlp
from fulmen.producers.otlp_gateway.otlp import decode_protobuf, split_by_trace, validate
from fulmen.schemas.errors import PoisonInputError

MAX_SPAN, MAX_RECORD = 7 * 1024, 8 * 1024


def reference(body: bytes, max_span: int = MAX_SPAN, max_record: int = MAX_RECORD) -> tuple:
    checked = validate(decode_protobuf(body), max_span)
    records = split_by_trace(checked.request, max_record) if checked.accepted else []
    keys, values = [r.key for r in records], [r.value for r in records]
    return checked.accepted, checked.rejected, checked.error_message(), keys, values


def native(body: bytes, max_span: int = MAX_SPAN, max_record: int = MAX_RECORD) -> tuple | None:
    assert otlp._split_on_wire is not None, "the native module is built by make install (cargo)"
    found = otlp._split_on_wire(body, max_span, max_record)
    if found is None:
        return None
    accepted, rejected, reasons, keys, values = found
    return accepted, rejected, "; ".join(sorted(reasons)), keys, values


def _many_scopes() -> bytes:
    """Two resources, three scopes, traces that cross them, schema urls, spans that are rejected."""
    request = ExportTraceServiceRequest()
    for r in range(2):
        source = make_request(12, seed=r, spans_per_trace=4, service=f"svc-{r}")
        resource_spans = request.resource_spans.add()
        resource_spans.CopyFrom(source.resource_spans[0])
        resource_spans.schema_url = f"https://example.com/{r}"
        extra = resource_spans.scope_spans.add()
        extra.CopyFrom(source.resource_spans[0].scope_spans[0])
        extra.scope.name = f"second-{r}"
        extra.schema_url = "https://example.com/scope"
    first = request.resource_spans[0].scope_spans[0].spans
    request.resource_spans[1].scope_spans[1].spans[0].trace_id = first[0].trace_id  # a trace across resources
    first[1].trace_id = b"short"
    first[2].span_id = bytes(8)
    request.resource_spans[0].scope_spans.add()  # a scope without spans
    return request.SerializeToString()


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(make_request(30, seed=1, spans_per_trace=10).SerializeToString(), id="three-traces"),
        pytest.param(make_request(5, seed=2, spans_per_trace=5).SerializeToString(), id="one-trace-whole-body"),
        pytest.param(make_request(40, seed=3, spans_per_trace=40).SerializeToString(), id="trace-cut-by-size"),
        pytest.param(make_request(60, seed=4, spans_per_trace=20).SerializeToString(), id="traces-cut-by-size"),
        pytest.param(_many_scopes(), id="resources-scopes-rejections"),
        pytest.param(b"", id="empty-request"),
    ],
)
def test_native_split_gives_the_reference_bytes(body: bytes) -> None:
    assert native(body) == reference(body)


def test_one_trace_body_is_passed_on_as_the_same_object() -> None:
    body = make_request(5, seed=2, spans_per_trace=5).SerializeToString()
    assert native(body)[4][0] is body


def test_what_the_walk_does_not_handle_goes_to_the_reference() -> None:
    request = make_request(2, seed=5, spans_per_trace=2)
    span_bytes = max(span.ByteSize() for span in request.resource_spans[0].scope_spans[0].spans)
    body = request.SerializeToString()
    assert native(body, max_span=span_bytes + 65) is not None
    assert native(body, max_span=span_bytes + 10) is None  # within the margin of the limit: measured re-encoded
    assert native(body, max_span=span_bytes - 1) is None
    group = wrap_span(field(1, bytes(range(1, 17))) + field(2, bytes(range(1, 9))) + b"\x1b\x1c")  # a group
    assert native(group) is None
    wrong_type = wrap_span(b"\x08\x01" + field(2, bytes(range(1, 9))))  # trace_id as a varint: unknown to protobuf
    assert native(wrong_type) is None
    assert otlp.prepare(wrong_type, False, MAX_SPAN, MAX_RECORD).rejected == 1  # the reference decides


def test_native_split_matches_the_reference_on_fuzzed_bodies() -> None:
    rng = random.Random(31)
    compared = 0
    for _ in range(400):
        _, body = protobuf_variant(rng)
        try:
            decode_protobuf(body)
        except PoisonInputError:
            continue  # refused before any split, as before
        found = native(body)
        if found is None:
            continue
        accepted, rejected, message, keys, values = reference(body)
        assert found[:4] == (accepted, rejected, message, keys)
        assert [ExportTraceServiceRequest.FromString(v) for v in found[4]] == [
            ExportTraceServiceRequest.FromString(v) for v in values
        ]
        compared += 1
    assert compared > 100
