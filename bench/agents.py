"""Agents for the benchmarks: they do no work, so what is measured is Fulmen's own cost per rollout."""

from __future__ import annotations

from opentelemetry import trace

_tracer = trace.get_tracer("fulmen.bench")


def noop(task: dict, llm: object) -> float:
    return 1.0


def ten_spans(task: dict, llm: object) -> float:
    """Ten spans per rollout (a typical small agent: steps, tool calls), exported by the runner's OTLP exporter."""
    for step in range(10):
        with _tracer.start_as_current_span(f"step {step}") as span:
            span.set_attribute("bench.step", step)
    return 1.0
