"""OTLP payload handling in the gateway (decode, validate, split by trace) and the Python span flattening."""

from __future__ import annotations

import json

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from bench.otlp_payloads import make_request
from fulmen.consumers.otlp_rows import SpanColumns, any_value_text
from fulmen.producers.otlp_gateway.decoding import BodyDecoder, DecoderCrashedError
from fulmen.producers.otlp_gateway.otlp import (
    decode_json,
    decode_protobuf,
    encode_response,
    prepare,
    split_by_trace,
    validate,
)
from fulmen.schemas import semconv
from fulmen.schemas.errors import PoisonInputError


def _otlp_json(request: ExportTraceServiceRequest) -> bytes:
    """The OTLP/JSON encoding: proto3 JSON, but ids in hex."""
    document = json_format.MessageToDict(request)
    for rs in document["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                for name in ("traceId", "spanId", "parentSpanId"):
                    if name in span:
                        span[name] = __import__("base64").b64decode(span[name]).hex()
    return json.dumps(document).encode()


def test_json_and_protobuf_decode_to_the_same_request() -> None:
    request = make_request(12, seed=3)
    assert decode_json(_otlp_json(request)) == request
    assert decode_protobuf(request.SerializeToString()) == request


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"[1]", "JSON object"),
        (b"{", "not JSON"),
        (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"spanId": "xyz"}]}]}]}', "spans[0].spanId"),
        (b'{"resourceSpans": 5}', None),
    ],
)
def test_bad_json_is_poison_with_a_reason(body: bytes, words: str | None) -> None:
    if words is None:
        with pytest.raises(PoisonInputError):
            decode_json(body)
        return
    with pytest.raises(PoisonInputError, match=words.replace("[", r"\[").replace("]", r"\]")):
        decode_json(body)


@pytest.mark.security
@pytest.mark.parametrize("field", ["kind", "droppedAttributesCount"])
def test_a_number_past_float_range_in_an_integer_field_is_poison(field: str) -> None:
    # bench/fuzz.py: protobuf's ParseDict raised OverflowError on ``-1e400`` (the gateway answered 500)
    body = b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"%s": -1e400}]}]}]}' % field.encode()
    with pytest.raises(PoisonInputError, match="not an OTLP"):
        decode_json(body)


def test_validate_drops_bad_spans_and_counts_them() -> None:
    request = make_request(5, seed=4, spans_per_trace=5)
    spans = request.resource_spans[0].scope_spans[0].spans
    spans[0].trace_id = b"short"
    spans[3].span_id = bytes(8)
    checked = validate(request, max_span_bytes=1 << 20)
    assert (checked.accepted, checked.rejected) == (3, 2)
    assert len(request.resource_spans[0].scope_spans[0].spans) == 3
    assert "trace_id" in checked.error_message() and "span_id" in checked.error_message()
    assert validate(make_request(2, seed=5), max_span_bytes=100).rejected == 2  # each span is ~1.2 KB


def test_split_makes_one_record_per_trace_keyed_by_trace_id() -> None:
    request = make_request(30, seed=6, spans_per_trace=10)
    records = split_by_trace(request, max_record_bytes=1 << 20)
    assert len(records) == 3 and sum(r.spans for r in records) == 30
    for record in records:
        part = ExportTraceServiceRequest.FromString(record.value)
        trace_ids = {s.trace_id.hex() for rs in part.resource_spans for ss in rs.scope_spans for s in ss.spans}
        assert trace_ids == {record.key.decode()}
        assert part.resource_spans[0].resource == request.resource_spans[0].resource


def test_split_cuts_a_trace_that_is_too_big_for_one_record() -> None:
    request = make_request(40, seed=7, spans_per_trace=40)
    records = split_by_trace(request, max_record_bytes=8 * 1024)
    assert len(records) > 1 and all(len(r.value) <= 8 * 1024 for r in records)
    assert sum(r.spans for r in records) == 40 and len({r.key for r in records}) == 1


def _mixed_body() -> tuple[bytes, list]:
    """A protobuf body with a rejected span and a trace too big for one record; and the records it must give."""
    request = make_request(60, seed=11, spans_per_trace=20)
    request.resource_spans[0].scope_spans[0].spans[5].span_id = bytes(8)
    body = request.SerializeToString()
    expected = validate(decode_protobuf(body), max_span_bytes=7 * 1024)
    return body, split_by_trace(expected.request, max_record_bytes=8 * 1024)


def test_prepare_gives_the_records_split_by_trace_gives() -> None:
    body, records = _mixed_body()
    prepared = prepare(body, False, 7 * 1024, 8 * 1024)
    assert (prepared.accepted, prepared.rejected) == (59, 1) and "span_id" in prepared.error_message
    assert prepared.keys == [r.key for r in records] and prepared.values == [r.value for r in records]
    unsplit = prepare(body, False, 7 * 1024, 8 * 1024, split=False)
    assert (unsplit.accepted, unsplit.keys, unsplit.values) == (59, [], [])


async def test_large_bodies_are_decoded_in_a_process_with_the_same_results() -> None:
    """The process path (bodies of ``process_body_bytes`` and up) answers exactly as the thread path does:
    the same records, the same 400 reason; a worker that dies fails its body alone, and the next body starts a
    fresh pool."""
    import os
    import signal

    body, records = _mixed_body()
    decoder = BodyDecoder(max_span_bytes=7 * 1024, max_record_bytes=8 * 1024, processes=1, process_body_bytes=1024)
    try:
        assert decoder.uses_process(len(body)) and not decoder.uses_process(1023)
        in_process = await decoder.prepare(body, False)
        on_thread = prepare(body, False, 7 * 1024, 8 * 1024)
        assert in_process == on_thread and in_process.values == [r.value for r in records]
        garbage = b"\xff" * 2048
        with pytest.raises(PoisonInputError) as from_process:
            await decoder.prepare(garbage, False)
        with pytest.raises(PoisonInputError) as from_thread:
            prepare(garbage, False, 7 * 1024, 8 * 1024)
        assert str(from_process.value) == str(from_thread.value)
        pool = decoder._pool
        assert pool is not None
        for pid in list(pool._processes):  # type: ignore[union-attr]
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(DecoderCrashedError, match="died"):
            await decoder.prepare(body, False)
        assert await decoder.prepare(body, False) == on_thread  # a fresh pool
    finally:
        decoder.close()


def test_partial_success_response() -> None:
    assert encode_response(0, "", as_json=True) == b"{}"
    assert json.loads(encode_response(2, "bad ids", as_json=True)) == {
        "partialSuccess": {"rejectedSpans": "2", "errorMessage": "bad ids"}
    }


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (AnyValue(string_value="héllo"), "héllo"),
        (AnyValue(int_value=-3), "-3"),
        (AnyValue(double_value=0.1), "0.1"),
        (AnyValue(double_value=1e16), "1e+16"),
        (AnyValue(bool_value=False), "false"),
        (AnyValue(), ""),
        (AnyValue(bytes_value=b"\x00\x01"), '"AAE="'),
    ],
)
def test_attribute_text_matches_the_collector(value: AnyValue, text: str) -> None:
    assert any_value_text(value) == text


def test_arrays_and_maps_become_compact_json() -> None:
    value = AnyValue()
    value.array_value.values.extend([AnyValue(int_value=1), AnyValue(string_value="é")])
    assert any_value_text(value) == '[1,"\\u00e9"]'
    kv = AnyValue()
    kv.kvlist_value.values.extend([KeyValue(key="a", value=AnyValue(bool_value=True))])
    assert any_value_text(kv) == '{"a":true}'


def test_token_arrays_go_to_typed_columns_and_bad_ones_stay_as_text() -> None:
    request = make_request(2, seed=8, spans_per_trace=2)
    good, bad = request.resource_spans[0].scope_spans[0].spans
    ids = AnyValue()
    ids.array_value.values.extend([AnyValue(int_value=5), AnyValue(int_value=6)])
    good.attributes.append(KeyValue(key=semconv.PROMPT_TOKEN_IDS, value=ids))
    negative = AnyValue()
    negative.array_value.values.extend([AnyValue(int_value=-1)])
    bad.attributes.append(KeyValue(key=semconv.PROMPT_TOKEN_IDS, value=negative))
    columns = SpanColumns()
    columns.add_request(request)
    table = columns.to_table().to_pylist()
    assert table[0]["PromptTokenIds"] == [5, 6]
    assert semconv.PROMPT_TOKEN_IDS not in dict(table[0]["SpanAttributes"])
    assert table[1]["PromptTokenIds"] == []
    attrs = dict(table[1]["SpanAttributes"])
    assert attrs[semconv.PROMPT_TOKEN_IDS] == "[-1]" and semconv.TOKEN_ARRAY_INVALID in attrs
