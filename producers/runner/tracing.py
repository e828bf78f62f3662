"""Tracing inside the runner: every span an agent makes carries its rollout's id and attempt.

The runner installs the global tracer provider, so spans from any instrumentation (the openai client's, a
framework's, the agent's own) pass through :class:`RolloutStamper`, which reads the rollout of the current
asyncio task (a context variable, copied into the worker thread of a sync agent) and stamps it on the span.
Spans are exported by OTLP/HTTP to the OTLP gateway and flushed before a rollout's end is reported.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from schemas import semconv
from schemas.events import RolloutRequest

__all__ = ["CURRENT_ROLLOUT", "RolloutStamper", "build_tracer_provider"]

CURRENT_ROLLOUT: ContextVar[RolloutRequest | None] = ContextVar("fulmen_current_rollout", default=None)


class RolloutStamper(SpanProcessor):
    """Sets rollout id, attempt, group and task on every span started while a rollout runs."""

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        request = CURRENT_ROLLOUT.get()
        if request is None:
            return
        span.set_attributes({
            semconv.ROLLOUT_ID: request.rollout_id, semconv.ROLLOUT_ATTEMPT: request.attempt,
            semconv.ROLLOUT_GROUP_ID: request.group_id, semconv.TASK_ID: request.task_id,
        })  # fmt: skip

    def on_end(self, span: ReadableSpan) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def build_tracer_provider(otlp_endpoint: str | None, *, install: bool = True) -> TracerProvider:
    """A provider that stamps rollouts and exports to ``otlp_endpoint`` (None: export nowhere)."""
    provider = TracerProvider(resource=Resource.create({semconv.SERVICE_NAME: "fulmen-agent"}))
    provider.add_span_processor(RolloutStamper())
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, timeout=30)))
    if install:
        _install(provider)
    return provider


def _install(provider: Any) -> None:
    # The global provider can be set once per process; the runner owns its process.
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        for processor in provider._active_span_processor._span_processors:
            current.add_span_processor(processor)
        return
    trace.set_tracer_provider(provider)
