"""An agent that sets up OpenTelemetry in its first call: its own ``TracerProvider`` with an OTLP exporter to
the runner's endpoint (``FULMEN_RUNNER_OTLP_ENDPOINT``). Installing it globally is refused (the runner's is
there already), so it traces on its provider object, as pydantic-ai does when given an explicit provider."""

from __future__ import annotations

import asyncio
import os

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

SPANS_PER_ROLLOUT = 3

_provider: TracerProvider | None = None


def _setup() -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": "own-tracer-late"}))
    exporter = OTLPSpanExporter(endpoint=os.environ["FULMEN_RUNNER_OTLP_ENDPOINT"])
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # refused with a warning: the global provider is set once
    return provider


async def run(task: dict, llm: object) -> float:
    """One ``agent run`` span with two ``chat`` children (``SPANS_PER_ROLLOUT``), on the agent's provider."""
    global _provider
    if _provider is None:  # no await between the check and the set: one provider even with concurrent calls
        _provider = _setup()
    tracer = _provider.get_tracer("own-tracer-late")
    with tracer.start_as_current_span("agent run"):
        for _ in range(SPANS_PER_ROLLOUT - 1):
            with tracer.start_as_current_span("chat"):
                await asyncio.sleep(0.01)
    return 1.0
