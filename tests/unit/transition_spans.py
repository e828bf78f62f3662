"""Hand-built span records for the transitions tests: a compact way to write a rollout's trace forest."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from fulmen.consumers.transitions.tree import SpanRecord
from fulmen.schemas import semconv

MAIN = "a" * 32  # the agent's trace


def tid(n: int) -> str:
    """A trace id (n = 0 is the agent's main trace)."""
    return MAIN if n == 0 else f"{n:032x}"


def sid(name: str) -> str:
    """A 16-hex span id derived from a readable name."""
    return hashlib.blake2b(name.encode(), digest_size=8).hexdigest()


def span(
    name: str,
    start: int,
    end: int,
    parent: str | None = None,
    *,
    trace: int = 0,
    agent: str = "",
    node: str | None = None,
    prompt: tuple[int, ...] = (),
    response: tuple[int, ...] = (),
    logprobs: tuple[float, ...] = (),
    reward: float | None = None,
    events: tuple[tuple[int, float], ...] = (),
    event_responses: tuple[str, ...] = (),
    links: tuple[str, ...] = (),
    response_id: str = "",
    version: int | None = None,
    span_name: str | None = None,
) -> SpanRecord:
    """One span called ``name`` (its id is derived from it) from ``start`` to ``end`` (ns)."""
    attributes: dict[str, Any] = {}
    if node is not None:
        attributes[semconv.OPENINFERENCE_METADATA] = json.dumps({"langgraph_node": node, "langgraph_step": 1})
    if response_id:
        attributes[semconv.GEN_AI_RESPONSE_ID] = response_id
    return SpanRecord(
        trace_id=tid(trace),
        span_id=sid(name),
        parent_span_id=sid(parent) if parent else "",
        name=span_name if span_name is not None else name,
        start_ns=start,
        end_ns=end,
        agent_name=agent,
        attributes=attributes,
        prompt_token_ids=prompt,
        response_token_ids=response,
        response_logprobs=logprobs,
        model_version=version,
        reward=reward,
        event_rewards=events,
        event_response_ids=event_responses,
        links=tuple((tid(0), sid(link)) for link in links),
    )


def call(name: str, start: int, end: int, parent: str | None = None, *, trace: int = 0, **fields: Any) -> SpanRecord:
    """An LLM gateway span: token ids derived from the start time, so each call is recognisable."""
    fields.setdefault("prompt", (start, start + 1))
    fields.setdefault("response", (end,))
    return span(name, start, end, parent, trace=trace, **fields)


def rollout_root(start: int = 0, end: int = 1000, reward: float | None = None) -> SpanRecord:
    return span("rollout", start, end, span_name=semconv.SPAN_ROLLOUT, reward=reward)


def langgraph_rollout() -> list[SpanRecord]:
    """write → check → rewrite as the openinference LangChain instrumentation records it; the LLM gateway's spans
    arrive as traces of their own (the agent does not propagate traceparent to the gateway)."""
    spans = [rollout_root(), span("graph", 10, 900, "rollout", span_name="write_check_rewrite")]
    for i, node in enumerate(("write", "check", "rewrite")):
        base = 100 + 250 * i
        spans.append(span(node, base, base + 200, "graph", node=node))
        spans.append(span(f"{node}-llm", base + 10, base + 190, node, node=node, span_name="ChatOpenAI"))
        spans.append(call(f"{node}-gw", base + 20, base + 180, trace=i + 1))
    return spans
