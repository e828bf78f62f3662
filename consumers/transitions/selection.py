"""Which spans of a rollout are the LLM calls to train on, whose agent made each, and in what order.

A call is a span that carries prompt and response token ids (the LLM gateway records them). Its *agent* is the
name found on the call span itself or, failing that, on its nearest ancestor that has one (LLM spans are
usually children of an agent or graph-node span). Where a framework records the agent name is a registry of
sources, tried in order:

* ``typed``: the spans table's ``AgentName`` column, which the spans consumer fills from
  ``semconv.AGENT_NAME_KEYS``: ``fulmen.agent.name``, ``gen_ai.agent.name`` (AutoGen's ``invoke_agent`` spans,
  the gen_ai conventions), ``agent.name`` (OpenInference, e.g. the OpenAI Agents SDK's agent spans),
  ``graph.node.name``;
* ``langgraph_node``: the ``langgraph_node`` entry of the OpenInference ``metadata`` JSON, which the LangChain
  instrumentation writes on every span inside a LangGraph node (the node span, its LLM spans...).

With an agent pattern, only the calls whose agent name matches it as a whole (``re.fullmatch``) are kept; a
call with no agent name is matched as the empty string. Repeated records of one call are counted once: the same
``gen_ai.response.id`` with the same token ids (one response recorded twice), or a call span nested in another
call span with the same token ids (two instrumentations recording one request). The first record in episode
order is kept. The choices of one request (``n`` > 1) share a response id but differ in their tokens, so each
is a call of its own; only two choices that sampled exactly the same tokens collapse into one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from fulmen.consumers.transitions.tree import SpanKey, SpanRecord, TraceTree
from fulmen.schemas import semconv
from fulmen.schemas.errors import ConfigurationError

__all__ = ["AGENT_NAME_SOURCES", "Call", "agent_name", "agent_of", "register_agent_source", "select_calls"]

AgentNameSource = Callable[[SpanRecord], str]
AGENT_NAME_SOURCES: dict[str, AgentNameSource] = {}

# A key inside the OpenInference ``metadata`` JSON (semconv.OPENINFERENCE_METADATA), not a span attribute.
LANGGRAPH_NODE_KEY = "langgraph_node"


def register_agent_source(name: str) -> Callable[[AgentNameSource], AgentNameSource]:
    """Decorator: add a place to find an agent name; sources are tried in registration order."""

    def decorate(source: AgentNameSource) -> AgentNameSource:
        if name in AGENT_NAME_SOURCES:
            raise ConfigurationError(f"agent name source {name!r} is already registered")
        AGENT_NAME_SOURCES[name] = source
        return source

    return decorate


@register_agent_source("typed")
def _typed_column(span: SpanRecord) -> str:
    return span.agent_name


@register_agent_source("langgraph_node")
def _langgraph_node(span: SpanRecord) -> str:
    text = span.attributes.get(semconv.OPENINFERENCE_METADATA, "")
    if LANGGRAPH_NODE_KEY not in text:
        return ""
    try:
        metadata = json.loads(text)
    except ValueError:
        return ""
    node = metadata.get(LANGGRAPH_NODE_KEY) if isinstance(metadata, dict) else None
    return node if isinstance(node, str) else ""


def agent_name(span: SpanRecord) -> str:
    """The agent name recorded on ``span`` itself ('' when none)."""
    for source in AGENT_NAME_SOURCES.values():
        name = source(span)
        if name:
            return name
    return ""


def agent_of(tree: TraceTree, key: SpanKey) -> str:
    """The agent name of ``key`` or of its nearest ancestor that has one ('' when none has)."""
    for ancestor in tree.ancestors(key):
        name = agent_name(tree.spans[ancestor])
        if name:
            return name
    return ""


@dataclass(frozen=True)
class Call:
    """One selected LLM call: its span and the agent that made it."""

    span: SpanRecord
    agent: str

    @property
    def key(self) -> SpanKey:
        return self.span.key


def select_calls(tree: TraceTree, agent_pattern: re.Pattern[str] | None = None) -> tuple[list[Call], int]:
    """The calls to train on in episode order, and how many distinct calls the rollout made in all."""
    calls: list[Call] = []
    by_response: dict[tuple[str, tuple[int, ...], tuple[int, ...]], int] = {}
    by_key: dict[SpanKey, int] = {}
    for key, span in tree.spans.items():
        if not span.is_llm_call:
            continue
        response_id = span.attributes.get(semconv.GEN_AI_RESPONSE_ID, "")
        response = (response_id, span.prompt_token_ids, span.response_token_ids)
        index = by_response.get(response) if response_id else None
        if index is None:
            index = _nested_duplicate(tree, key, calls, by_key)
        agent = agent_of(tree, key)
        if index is not None:
            if agent and not calls[index].agent:  # the other record knew the agent: keep that
                calls[index] = Call(calls[index].span, agent)
            continue
        if response_id:
            by_response[response] = len(calls)
        by_key[key] = len(calls)
        calls.append(Call(span, agent))
    selected = [c for c in calls if agent_pattern is None or agent_pattern.fullmatch(c.agent)]
    return selected, len(calls)


def _nested_duplicate(tree: TraceTree, key: SpanKey, calls: list[Call], kept: dict[SpanKey, int]) -> int | None:
    """The index of a call already kept that encloses ``key`` in the tree and has the same token ids."""
    span = tree.spans[key]
    for ancestor in tree.ancestors(key, include_self=False):
        index = kept.get(ancestor)
        if index is not None:
            other = calls[index].span
            same = (other.prompt_token_ids, other.response_token_ids) == (
                span.prompt_token_ids,
                span.response_token_ids,
            )
            if same:
                return index
    return None
