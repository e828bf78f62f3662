"""The reward and annotation helpers make spans the spans table reads rewards from."""

from __future__ import annotations

import math

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import ProxyTracerProvider

from fulmen.consumers.otlp_rows import SpanColumns
from fulmen.producers import agent_helpers
from fulmen.schemas import semconv


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(agent_helpers, "_tracer", provider.get_tracer("test"))
    return exporter


def test_emit_reward_nests_under_the_current_span(exported: InMemorySpanExporter) -> None:
    tracer = agent_helpers._tracer
    with tracer.start_as_current_span("chat tiny") as chat:
        agent_helpers.emit_reward(0.75, name="format_ok", judge="regex")
    reward = next(s for s in exported.get_finished_spans() if s.name == semconv.SPAN_REWARD)
    assert reward.parent.span_id == chat.get_span_context().span_id
    assert reward.attributes[semconv.REWARD_VALUE] == 0.75
    assert reward.attributes[semconv.REWARD_NAME] == "format_ok"
    assert reward.attributes[f"{semconv.ANNOTATION_PREFIX}judge"] == "regex"


def test_rewards_land_in_the_reward_column(exported: InMemorySpanExporter) -> None:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    agent_helpers.emit_reward(1)
    agent_helpers.emit_annotation("attempted_tool", tool="calculator")
    columns = SpanColumns()
    columns.add_request(encode_spans(exported.get_finished_spans()))
    rows = columns.to_table().to_pylist()
    assert [r["Reward"] for r in rows] == [1.0, None]
    assert dict(rows[1]["SpanAttributes"])[f"{semconv.ANNOTATION_PREFIX}tool"] == "calculator"


@pytest.mark.parametrize("bad", [math.nan, math.inf, "1", None, True])
def test_rewards_must_be_finite_numbers(bad: object) -> None:
    with pytest.raises(ValueError, match="finite number"):
        agent_helpers.emit_reward(bad)  # type: ignore[arg-type]


def test_helpers_work_without_any_tracing_set_up() -> None:
    assert isinstance(trace.get_tracer_provider(), ProxyTracerProvider | TracerProvider)
    agent_helpers.emit_reward(0.5)  # a no-op tracer: nothing raised, nothing required
