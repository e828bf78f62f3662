"""Realistic OTLP trace payloads for the benchmarks: agent-like spans of about 1 KB with ~20 attributes."""

from __future__ import annotations

import os
import random
import time

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from fulmen.schemas import semconv

_SENTENCE = "the agent plans a tool call reads the result and answers the question about the weather in paris"
_WORDS = _SENTENCE.split(" ")


def _kv(key: str, value: object) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def make_request(
    n_spans: int, *, service: str = "bench-agent", marker: str = "", seed: int | None = None, spans_per_trace: int = 10
) -> ExportTraceServiceRequest:
    """One export batch: ``n_spans`` spans in traces of ``spans_per_trace``, each ~1 KB with ~20 attributes.

    ``marker`` goes into every span's ``bench.marker`` attribute, so a benchmark can find its batch with SQL.
    """
    rng = random.Random(seed)
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.extend(
        [
            _kv("service.name", service),
            _kv("service.version", "1.4.2"),
            _kv("telemetry.sdk.language", "python"),
            _kv("telemetry.sdk.name", "opentelemetry"),
            _kv("host.name", "worker-7"),
        ]
    )
    scope_spans = resource_spans.scope_spans.add()
    scope_spans.scope.name = "bench.agent"
    scope_spans.scope.version = "0.1"
    now = time.time_ns()
    trace_id, parent = os.urandom(16), b""
    for i in range(n_spans):
        if i % spans_per_trace == 0:
            trace_id, parent = os.urandom(16), b""
        span = scope_spans.spans.add()
        span.trace_id, span.span_id = trace_id, os.urandom(8)
        span.parent_span_id = parent
        parent = parent or span.span_id
        span.name = "chat tiny-model" if i % 2 else "execute_tool calculator"
        span.kind = Span.SPAN_KIND_CLIENT if i % 2 else Span.SPAN_KIND_INTERNAL
        span.start_time_unix_nano = now - 5_000_000
        span.end_time_unix_nano = now
        span.status.code = Status.STATUS_CODE_OK
        span.attributes.extend(
            [
                _kv(semconv.GEN_AI_OPERATION_NAME, "chat"),
                _kv(semconv.GEN_AI_SYSTEM, "fulmen"),
                _kv(semconv.GEN_AI_REQUEST_MODEL, "tiny-model"),
                _kv(semconv.GEN_AI_RESPONSE_MODEL, "tiny-model"),
                _kv(semconv.GEN_AI_REQUEST_TEMPERATURE, 1.0),
                _kv(semconv.GEN_AI_REQUEST_MAX_TOKENS, 256),
                _kv(semconv.GEN_AI_USAGE_INPUT_TOKENS, rng.randint(50, 500)),
                _kv(semconv.GEN_AI_USAGE_OUTPUT_TOKENS, rng.randint(5, 100)),
                _kv(semconv.GEN_AI_RESPONSE_ID, f"chatcmpl-{rng.getrandbits(64):x}"),
                _kv(semconv.GEN_AI_RESPONSE_FINISH_REASONS, "stop"),
                _kv(semconv.GEN_AI_AGENT_NAME, "solver"),
                _kv(semconv.GEN_AI_INPUT_MESSAGES, _text(rng, 60)),
                _kv(semconv.GEN_AI_OUTPUT_MESSAGES, _text(rng, 25)),
                _kv(semconv.ROLLOUT_ID, f"rollout-{i // spans_per_trace}"),
                _kv(semconv.ROLLOUT_ATTEMPT, 1),
                _kv(semconv.MODEL_VERSION, 3),
                _kv("http.status_code", 200),
                _kv("server.address", "127.0.0.1"),
                _kv("bench.marker", marker),
                _kv("bench.index", i),
            ]
        )
    return request
