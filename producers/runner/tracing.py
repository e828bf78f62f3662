"""Tracing inside the runner: every span an agent makes carries its rollout's id and attempt.

The runner installs the global tracer provider, so spans from any instrumentation (the openai client's, a
framework's, the agent's own) pass through :class:`RolloutStamper`, which reads the rollout of the current
asyncio task (a context variable, copied into the worker thread of a sync agent) and stamps it on the span.
Spans are exported by OTLP/HTTP to the OTLP gateway and flushed before a rollout's end is reported.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from schemas import semconv
from schemas.events import RolloutRequest

__all__ = ["CURRENT_ROLLOUT", "CoalescedFlush", "RolloutStamper", "build_tracer_provider"]

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


class CoalescedFlush:
    """Flushes the provider for many finishing rollouts at once.

    A rollout's spans must be exported before its end is reported. Each flush is a round trip to the OTLP
    endpoint, so rollouts that finish while a flush is running wait for the next one, which covers all of
    them: one flush per wave of finishing rollouts instead of one per rollout.
    """

    def __init__(self, provider: Any) -> None:
        self.provider = provider
        self._waiting: list[asyncio.Future[None]] = []
        self._running: asyncio.Task[None] | None = None

    async def flush(self) -> None:
        """Return once every span ended before this call has been exported (or the flush gave up)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._drain())
        await future

    async def _drain(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, []
            try:
                await asyncio.to_thread(self.provider.force_flush)
            finally:
                for future in batch:
                    if not future.done():
                        future.set_result(None)
