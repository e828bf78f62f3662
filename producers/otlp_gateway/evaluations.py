"""OpenTelemetry evaluations as late feedback: a ``gen_ai.evaluation.result`` span event that names the response it
rates becomes a :class:`~fulmen.schemas.events.Feedback`, published beside the spans, so it lands where
``POST /v1/feedback`` lands (the ``feedback`` table, resolved to the call by the feedback consumer), latest wins
among them as among any feedback.

Which events: name ``gen_ai.evaluation.result``, a numeric ``gen_ai.evaluation.score.value``, and a
``gen_ai.response.id`` on the event or, failing that, on the span that carries it (an agent's own LLM span). The
feedback is named ``reward`` (the transitions count every evaluation score as the call's reward, and so does
replay), its comment is ``<gen_ai.evaluation.name>: <gen_ai.evaluation.explanation>``, its time the event's, its
source ``otel``, and its id is derived from where the
event is (trace, span, event index), so an exporter's retry of the same spans gives the same feedback, stored
once. An event that cannot be feedback (no response id, no finite score, an id outside the contract) is left as
it is: the span itself is stored either way, and a rollout's transitions still count it as the call's reward.
Pure functions, no I/O: they run where the export is decoded.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from pydantic import ValidationError

from fulmen.schemas import semconv
from fulmen.schemas.events import Feedback, FeedbackTarget

__all__ = ["EVALUATION_EVENT", "evaluation_feedback"]

EVALUATION_EVENT = "gen_ai.evaluation.result"
SOURCE = "otel"


def evaluation_feedback(request: ExportTraceServiceRequest) -> list[Feedback]:
    """The feedback the request's evaluation events give (module docstring), in the order they appear."""
    found = []
    for span, index, event in _evaluation_events(request):
        attributes = _values(event.attributes)
        score = attributes.get(semconv.GEN_AI_EVALUATION_SCORE_VALUE)
        response_id = attributes.get(semconv.GEN_AI_RESPONSE_ID) or _values(span.attributes).get(
            semconv.GEN_AI_RESPONSE_ID
        )
        if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
            continue
        if not isinstance(response_id, str) or not response_id:
            continue
        said = (semconv.GEN_AI_EVALUATION_NAME, semconv.GEN_AI_EVALUATION_EXPLANATION)
        comment = ": ".join(str(attributes[key]) for key in said if key in attributes)
        where = f"{span.trace_id.hex()}/{span.span_id.hex()}/{index}"
        try:
            found.append(
                Feedback(
                    feedback_id=f"otel-{hashlib.sha256(where.encode()).hexdigest()[:32]}",
                    target=FeedbackTarget.RESPONSE,
                    target_id=response_id,
                    name="reward",
                    value=float(score),
                    source=SOURCE,
                    comment=comment[:4096],
                    timestamp=datetime.fromtimestamp((event.time_unix_nano or span.end_time_unix_nano) / 1e9, UTC),
                )
            )
        except (ValidationError, ValueError, OverflowError, OSError):
            continue  # not what the contract takes (an id with spaces, a timestamp out of range): the span stays
    return found


def _evaluation_events(request: ExportTraceServiceRequest) -> Iterator[tuple[Any, int, Any]]:
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                for index, event in enumerate(span.events):
                    if event.name == EVALUATION_EVENT:
                        yield span, index, event


def _values(attributes: Any) -> dict[str, Any]:
    """Scalar attribute values by key (strings, numbers, booleans; arrays and maps are not wanted here)."""
    values: dict[str, Any] = {}
    for attribute in attributes:
        kind = attribute.value.WhichOneof("value")
        if kind in ("string_value", "int_value", "double_value", "bool_value"):
            values[attribute.key] = getattr(attribute.value, kind)
    return values
