"""A LangGraph agent as a user writes one: a StateGraph write → check → rewrite, each node one LLM call.

Signature ``write_check_rewrite(task, llm) -> float`` (sync; the runner runs it in a worker thread). ``task`` may
hold ``topic`` (str) and ``stream`` (bool: the nodes stream their completions, ``stream_usage`` on). Exactly three
chat completions per run, none retried (``max_retries=0``), so the number of LLM calls is bounded. Reward: 1.0
when the rewritten text is non-empty, else 0.0.

Tracing is the framework's own: openinference's ``LangChainInstrumentor`` on the global tracer provider,
installed once per process (first call; module-level guard, thread-safe). It imports nothing of Fulmen's.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from openinference.instrumentation.langchain import LangChainInstrumentor

__all__ = ["NODES", "write_check_rewrite"]

logger = logging.getLogger(__name__)

NODES = ("write", "check", "rewrite")
_instrumented = False
_instrument_lock = threading.Lock()


def instrument_once() -> None:
    """Instrument LangChain (and so LangGraph) for OpenTelemetry, the first time only."""
    global _instrumented
    with _instrument_lock:
        if not _instrumented:
            LangChainInstrumentor().instrument()
            _instrumented = True


class Draft(TypedDict, total=False):
    """The graph state: the topic, then what each node adds."""

    topic: str
    draft: str
    verdict: str
    final: str


def _ask(chat: ChatOpenAI, system: str, user: str) -> str:
    reply = chat.invoke([SystemMessage(system), HumanMessage(user)])
    return reply.content if isinstance(reply.content, str) else str(reply.content)


def build_graph(chat: ChatOpenAI) -> Any:
    """The compiled graph; its three nodes share ``chat`` (one client per run, scoped to the rollout)."""

    def write(state: Draft) -> Draft:
        return {"draft": _ask(chat, "You write one short sentence.", f"Write about {state['topic']}.")}

    def check(state: Draft) -> Draft:
        return {"verdict": _ask(chat, "Answer OK or REVISE.", f"Is this sentence clear?\n{state['draft']}")}

    def rewrite(state: Draft) -> Draft:
        prompt = f"Rewrite this sentence. Reviewer said: {state['verdict']}\n{state['draft']}"
        return {"final": _ask(chat, "You rewrite sentences.", prompt)}

    graph = StateGraph(Draft)
    for name, node in zip(NODES, (write, check, rewrite), strict=True):
        graph.add_node(name, node)
    graph.add_edge(START, "write")
    graph.add_edge("write", "check")
    graph.add_edge("check", "rewrite")
    graph.add_edge("rewrite", END)
    return graph.compile(name="write_check_rewrite")


def write_check_rewrite(task: dict[str, Any], llm: Any) -> float:
    """Run the graph once on ``task['topic']``; 1.0 when the final text is non-empty."""
    instrument_once()
    stream = bool(task.get("stream", False))
    chat = ChatOpenAI(
        base_url=llm.base_url,
        api_key=llm.api_key,
        model=llm.model,
        max_retries=0,
        timeout=120,
        max_tokens=64,
        streaming=stream,
        stream_usage=stream,
    )
    state = build_graph(chat).invoke({"topic": str(task.get("topic", "rivers"))}, {"recursion_limit": 10})
    final = state.get("final", "").strip()
    logger.debug("langgraph agent: final text %r", final[:80])
    return 1.0 if final else 0.0
