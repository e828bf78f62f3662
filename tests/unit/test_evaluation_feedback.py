"""OpenTelemetry evaluation events as late feedback (``producers/otlp_gateway/evaluations.py``): which events become
a Feedback, with what, and that an exporter's retry gives the same feedback ids."""

from __future__ import annotations

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from fulmen.producers.otlp_gateway.evaluations import evaluation_feedback
from fulmen.producers.otlp_gateway.otlp import prepare

pytestmark = pytest.mark.continuous


def attribute(key: str, value: object) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


def export(*events: dict[str, object], span_response: str | None = None) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.name = bytes.fromhex("ab" * 16), bytes.fromhex("cd" * 8), "chat"
    span.start_time_unix_nano, span.end_time_unix_nano = 1_764_800_000_000_000_000, 1_764_800_001_000_000_000
    if span_response:
        span.attributes.append(attribute("gen_ai.response.id", span_response))
    for index, attributes in enumerate(events):
        event = span.events.add()
        event.name = str(attributes.pop("name", "gen_ai.evaluation.result"))
        event.time_unix_nano = 1_764_800_002_000_000_000 + index
        event.attributes.extend(attribute(k, v) for k, v in attributes.items())
    return request


def test_an_evaluation_naming_a_response_is_a_reward_for_that_call() -> None:
    request = export(
        {
            "gen_ai.evaluation.name": "helpfulness",
            "gen_ai.evaluation.score.value": 0.75,
            "gen_ai.evaluation.explanation": "solved it",
            "gen_ai.response.id": "chatcmpl-1",
        },
        {"gen_ai.evaluation.score.value": 1},  # no response id on the event: the span's
        {"gen_ai.evaluation.score.value": float("nan"), "gen_ai.response.id": "chatcmpl-1"},  # not a score
        {"gen_ai.evaluation.score.value": "high", "gen_ai.response.id": "chatcmpl-1"},  # a label, not a number
        {"name": "other.event", "gen_ai.evaluation.score.value": 1.0, "gen_ai.response.id": "chatcmpl-1"},
        span_response="chatcmpl-span",
    )
    found = evaluation_feedback(request)
    assert [(f.target.value, f.target_id, f.name, f.value, f.source) for f in found] == [
        ("response", "chatcmpl-1", "reward", 0.75, "otel"),
        ("response", "chatcmpl-span", "reward", 1.0, "otel"),
    ]
    assert found[0].comment == "helpfulness: solved it" and found[0].timestamp.year == 2025
    assert [f.feedback_id for f in evaluation_feedback(request)] == [f.feedback_id for f in found]  # a retry: same ids
    assert len({f.feedback_id for f in found}) == 2


def test_without_a_response_id_there_is_no_feedback_and_prepare_carries_what_there_is() -> None:
    assert evaluation_feedback(export({"gen_ai.evaluation.score.value": 1.0})) == []
    body = export({"gen_ai.evaluation.score.value": 0.5, "gen_ai.response.id": "chatcmpl-9"}).SerializeToString()
    prepared = prepare(body, False, 1 << 20, 1 << 20)
    assert prepared.accepted == 1 and prepared.feedback_keys == [b"chatcmpl-9"]
    assert b'"source":"otel"' in prepared.feedback_values[0]
    plain = prepare(export().SerializeToString(), False, 1 << 20, 1 << 20)
    assert plain.feedback_keys == [] and plain.feedback_values == []
