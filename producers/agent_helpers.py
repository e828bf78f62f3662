"""Optional helpers for agents that want to report rewards and notes as spans (none are required).

An agent that imports nothing of Fulmen's can still return its reward, or set ``fulmen.reward.value`` on any
span. These helpers only save spelling the attribute names. They use the global OpenTelemetry tracer provider,
so the spans go wherever the agent's other spans go, and they nest under the current span: a reward emitted
right after an LLM call follows that call in the trace, which is how intermediate rewards are matched to calls.

    from fulmen.producers.agent_helpers import emit_reward
    emit_reward(1.0)                      # the final answer was right
    emit_reward(0.2, name="format_ok")    # an intermediate, named reward
"""

from __future__ import annotations

import math

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from fulmen.schemas import semconv

__all__ = ["emit_annotation", "emit_reward"]

_tracer = trace.get_tracer("fulmen.agent_helpers")


def emit_reward(value: float, name: str = "reward", **attributes: AttributeValue) -> None:
    """Record a reward as a ``fulmen.reward`` span. ``value`` must be a finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"a reward must be a finite number, not {value!r}")
    span_attributes: dict[str, AttributeValue] = {
        f"{semconv.ANNOTATION_PREFIX}{key}": v for key, v in attributes.items()
    }
    span_attributes[semconv.REWARD_VALUE] = float(value)
    span_attributes[semconv.REWARD_NAME] = name
    with _tracer.start_as_current_span(semconv.SPAN_REWARD, attributes=span_attributes):
        pass


def emit_annotation(name: str, **attributes: AttributeValue) -> None:
    """Record a note (a tag, a metric, a label) as a ``fulmen.annotation`` span."""
    if not name:
        raise ValueError("an annotation needs a name")
    span_attributes = {f"{semconv.ANNOTATION_PREFIX}{key}": v for key, v in attributes.items()}
    span_attributes[f"{semconv.ANNOTATION_PREFIX}name"] = name
    with _tracer.start_as_current_span(semconv.SPAN_ANNOTATION, attributes=span_attributes):
        pass
