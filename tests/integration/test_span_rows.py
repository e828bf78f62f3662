"""The native span flattening writes exactly the rows of the pure-Python reference, whatever the spans hold."""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from bench.otlp_payloads import make_request
from fulmen.consumers.otlp_rows import SPAN_SCHEMA
from fulmen.consumers.spans import SpanBlock, SpanSink, native_flattener
from fulmen.consumers.transitions.feed import feed_span_record
from fulmen.consumers.transitions.reader import SpanReader
from fulmen.infra.store import Store
from fulmen.schemas import semconv
from fulmen.schemas.errors import DecodeError

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        native_flattener() is None, reason="the native flattener is not built (needs cargo: make install)"
    ),
]

scalars = st.one_of(
    st.text(max_size=12).map(lambda s: AnyValue(string_value=s)),
    st.integers(-(2**63), 2**63 - 1).map(lambda i: AnyValue(int_value=i)),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: AnyValue(double_value=f)),
    st.sampled_from([1e16, 1e-5, 0.0001, 123456789.125, -0.0, 5e-324, 1.7976931348623157e308]).map(
        lambda f: AnyValue(double_value=f)
    ),
    st.booleans().map(lambda b: AnyValue(bool_value=b)),
    # Texts where float() and a strict reader differ, and integers at the edges of the typed columns.
    st.sampled_from(["٣", "1_0", " 5 ", "\x1c7", "1e400", "nan", "-inf", "+.5e1", "3.", "-0.0", "0x10", "", " "]).map(
        lambda t: AnyValue(string_value=t)
    ),
    st.sampled_from([2**63 - 1, 2**63 - 512, 2**32 - 1, 2**32, -1, 0]).map(lambda i: AnyValue(int_value=i)),
    st.binary(max_size=8).map(lambda b: AnyValue(bytes_value=b)),
    st.just(AnyValue()),
)


def _array(values: list[AnyValue]) -> AnyValue:
    value = AnyValue()
    value.array_value.values.extend(values)
    return value


def _kvlist(pairs: list[tuple[str, AnyValue]]) -> AnyValue:
    value = AnyValue()
    value.kvlist_value.values.extend(KeyValue(key=k, value=v) for k, v in pairs)
    return value


values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3).map(_array)
        | st.lists(st.tuples(st.sampled_from(["a", "b", "é"]), inner), max_size=3).map(_kvlist)
    ),
    max_leaves=6,
)
keys = st.sampled_from(
    [
        "k1",
        "k2",
        "ünï",
        semconv.ROLLOUT_ID,
        semconv.ROLLOUT_ATTEMPT,
        semconv.MODEL_VERSION,
        semconv.GEN_AI_AGENT_NAME,
        semconv.AGENT_NAME,
        semconv.REWARD_VALUE,
        semconv.GEN_AI_EVALUATION_SCORE_VALUE,
        semconv.SERVICE_NAME,
    ]
)
token_arrays = st.one_of(
    st.lists(st.integers(0, 2**32 - 1), max_size=6).map(lambda ids: _array([AnyValue(int_value=i) for i in ids])),
    st.lists(st.integers(-5, 2**33), min_size=1, max_size=3).map(
        lambda ids: _array([AnyValue(int_value=i) for i in ids])
    ),
    st.lists(st.floats(-30, 0), max_size=4).map(lambda xs: _array([AnyValue(double_value=x) for x in xs])),
    values,
)


@st.composite
def requests(draw: st.DrawFn) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(1, 2))):
        resource_spans = request.resource_spans.add()
        resource_spans.resource.attributes.extend(
            KeyValue(key=k, value=v) for k, v in draw(st.lists(st.tuples(keys, values), max_size=3))
        )
        scope_spans = resource_spans.scope_spans.add()
        scope_spans.scope.name = draw(st.text(max_size=5))
        for _ in range(draw(st.integers(0, 3))):
            span = scope_spans.spans.add()
            span.trace_id, span.span_id = os.urandom(16), os.urandom(8)
            span.parent_span_id = draw(st.sampled_from([b"", os.urandom(8)]))
            span.name = draw(st.text(max_size=10))
            span.kind = draw(st.integers(0, 7))
            span.start_time_unix_nano = draw(st.integers(10**18, 2 * 10**18))
            span.end_time_unix_nano = span.start_time_unix_nano + draw(st.integers(-5, 10**9))
            span.status.code = draw(st.integers(0, 3))
            span.status.message = draw(st.text(max_size=5))
            span.attributes.extend(
                KeyValue(key=k, value=v) for k, v in draw(st.lists(st.tuples(keys, values), max_size=6))
            )
            for key in draw(st.lists(st.sampled_from(semconv.TOKEN_ARRAY_KEYS), max_size=3)):
                span.attributes.append(KeyValue(key=key, value=draw(token_arrays)))
            for _ in range(draw(st.integers(0, 2))):
                event = span.events.add(time_unix_nano=span.start_time_unix_nano, name=draw(st.text(max_size=4)))
                event.attributes.extend(
                    KeyValue(key=k, value=v) for k, v in draw(st.lists(st.tuples(keys, values), max_size=2))
                )
            if draw(st.booleans()):
                link = span.links.add(trace_id=os.urandom(16), span_id=os.urandom(8), trace_state="a=1")
                link.attributes.append(KeyValue(key="why", value=draw(values)))
    return request


def _rows(store: Store, table: str) -> list[list]:
    rows = store.query(f"SELECT * EXCEPT IngestedAt FROM {store.database}.{table} ORDER BY SpanId", final=False).rows
    return [[_nan_safe(v) for v in row] for row in rows]


def _nan_safe(value: object) -> object:
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, list):
        return [_nan_safe(v) for v in value]
    return value


@settings(
    max_examples=int(os.environ.get("SPAN_ROWS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=st.lists(requests(), min_size=1, max_size=3))
def test_native_rows_equal_the_reference(store: Store, batch: list[ExportTraceServiceRequest]) -> None:
    for table in ("native_spans", "python_spans"):
        store.command(f"CREATE TABLE IF NOT EXISTS {store.database}.{table} AS {store.database}.otel_traces")
        store.command(f"TRUNCATE TABLE {store.database}.{table}")
    native, python = SpanSink(native=True), SpanSink(native=False)
    payloads = [r.SerializeToString() for r in batch]
    store.insert_batch("native_spans", native.to_batch(payloads))
    store.insert_batch("python_spans", python.to_batch([ExportTraceServiceRequest.FromString(p) for p in payloads]))
    assert _rows(store, "native_spans") == _rows(store, "python_spans")


@settings(
    max_examples=int(os.environ.get("SPAN_ROWS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=st.lists(requests(), min_size=1, max_size=3))
def test_feed_records_equal_what_the_store_answers_the_transitions_reader(
    store: Store, batch: list[ExportTraceServiceRequest]
) -> None:
    """The span feed's records (``flatten_records``) give the transitions builder exactly the spans it would read
    back from the store: one record per stamped span of a wanted rollout; the others' attempts named once."""
    store.command(f"TRUNCATE TABLE {store.table('otel_traces')}")
    payloads = [r.SerializeToString() for r in batch]
    flattener = native_flattener()
    _, _, none, skipped = flattener.flatten_records(payloads, set())
    data, rows, records, rest = flattener.flatten_records(payloads, {rollout for rollout, _ in skipped})
    assert [r[:4] for r in flattener.flatten_records(payloads, None)[2]] == [r[:4] for r in records]  # None: all
    store.insert_batch("otel_traces", SpanBlock(tuple(flattener.columns()), data, rows, records=records))
    table = store.table("otel_traces")
    stamped = store.query(f"SELECT DISTINCT RolloutId, Attempt FROM {table} WHERE RolloutId != ''").rows
    assert none == [] and rest == [] and sorted(skipped) == sorted(tuple(key) for key in stamped)
    assert len(records) == store.query(f"SELECT count() FROM {table} WHERE RolloutId != ''").rows[0][0]
    fed: dict = {}
    for record in records:
        fed.setdefault((record[0], record[1]), {})[(record[2], record[3])] = feed_span_record(record)
    read = SpanReader(store).spans(fed)
    assert {key: _by_id(spans) for key, spans in read.items()} == {
        key: {k: _nan_safe_record(v) for k, v in spans.items()} for key, spans in fed.items()
    }


def _by_id(spans: list) -> dict:
    return {(s.trace_id, s.span_id): _nan_safe_record(s) for s in spans}


def _nan_safe_record(record: object) -> object:
    return repr(record)  # NaN != NaN: compare the texts (the same value prints the same)


def test_native_block_has_the_columns_of_the_reference() -> None:
    """The Native block names the columns of SPAN_SCHEMA, in its order (the insert lists them so)."""
    assert tuple(native_flattener().columns()) == tuple(SPAN_SCHEMA.names)


def test_native_flatten_rejects_what_protobuf_rejects() -> None:
    flattener = native_flattener()
    assert flattener.flatten([ExportTraceServiceRequest().SerializeToString()])[1] == 0
    with pytest.raises(ValueError):
        flattener.flatten([ExportTraceServiceRequest().SerializeToString(), b"\x0a\x05garbage"])
    assert flattener.flatten([ExportTraceServiceRequest().SerializeToString()])[1] == 0  # usable after a failure


def test_the_sink_raises_a_decode_error_for_a_batch_with_a_record_that_does_not_decode() -> None:
    sink = SpanSink()
    good = make_request(3).SerializeToString()
    with pytest.raises(DecodeError, match="not valid OTLP protobuf"):
        sink.to_batch([good, b"\x0a\x05garbage"])
    assert sink.to_batch([good]).num_rows == 3
