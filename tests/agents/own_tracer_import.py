"""An agent that sets up OpenTelemetry at import, as pydantic-ai's docs say: its own ``TracerProvider`` with
an OTLP exporter, installed globally. It imports nothing of Fulmen's; the endpoint is the runner's
(``FULMEN_RUNNER_OTLP_ENDPOINT``), as a user would point it at the OTLP gateway."""

from __future__ import annotations

import asyncio
import os

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

SPANS_PER_ROLLOUT = 3

provider = TracerProvider(resource=Resource.create({"service.name": "own-tracer-import"}))
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=os.environ["FULMEN_RUNNER_OTLP_ENDPOINT"])))
trace.set_tracer_provider(provider)


async def run(task: dict, llm: object) -> float:
    """One ``agent run`` span with two ``chat`` children (``SPANS_PER_ROLLOUT``)."""
    tracer = trace.get_tracer("own-tracer-import")
    with tracer.start_as_current_span("agent run"):
        for _ in range(SPANS_PER_ROLLOUT - 1):
            with tracer.start_as_current_span("chat"):
                await asyncio.sleep(0.01)
    return 1.0
