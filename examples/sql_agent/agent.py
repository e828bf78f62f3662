"""The SQL agent: a LangGraph StateGraph write -> check -> rewrite, each node one ``ChatOpenAI`` call.

Plain LangGraph code; the Fulmen-specific lines are the ``base_url`` the runner hands it and the OpenTelemetry
instrumentation LangChain users already turn on (openinference's ``LangChainInstrumentor``), which records each
node and each LLM call with the node's name (``langgraph_node``): that is the agent name Fulmen selects by, so
``FULMEN_TRANSITIONS_AGENT_PATTERN='write|rewrite'`` trains the writer and the rewriter, not the checker. Each node
has its own ``ChatOpenAI`` on its own ``base_url`` (``llm.for_agent(node)``: the runner's URL with the node's name),
so that with ``FULMEN_TRAIN_ADAPTERS=per_agent`` the gateway serves each node its own LoRA adapter (and the checker,
which has none, the base model).

The graph: ``write`` drafts a query from the question and the schema of the task's database (``task["db"]``, one
of the generated databases of :mod:`examples.sql_agent.database`; a task input without it runs on the original
shop database); the query runs on that database (read-only, 1 s limit) and ``check`` sees the query with its
result or error and answers ``OK`` or a short critique; on a critique ``rewrite`` writes a corrected query, which
runs and goes back to ``check``. ``rewrite`` runs at most twice, so
an episode makes 2 to 6 LLM calls (write, check, [rewrite, check] x 2). Reward: the final query's result equals
the gold query's on the same database (1/0, :mod:`examples.sql_agent.reward`). The schema goes in the user
message (:func:`write_request`, :func:`rewrite_request`), so each node's system prompt is the same text on every
database: what the teacher tells the nodes apart by, and the slot ``fulmen optimize-prompt`` rewrites.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from openinference.instrumentation.langchain import LangChainInstrumentor

from examples.sql_agent.database import database_path, run_query, schema_text
from examples.sql_agent.reward import reward

__all__ = [
    "MAX_CALLS",
    "MAX_REWRITES",
    "NODES",
    "build_graph",
    "extract_sql",
    "rewrite_request",
    "run",
    "write_request",
]

MAX_REWRITES = 2
MAX_CALLS = 2 + 2 * MAX_REWRITES
DEFAULT_MAX_TOKENS = 96
WRITE = "Write one SQLite query that answers the question, over the tables given. Reply with the SQL only."
CHECK = "You review SQL. Reply OK if the query answers the question, else say briefly what is wrong."
REWRITE = "Fix the SQLite query, over the tables given. Reply with the corrected SQL only."
_FENCE = re.compile(r"```(?:sql)?\s*(.*?)```", re.DOTALL | re.IGNORECASE)
_START = re.compile(r"\b(SELECT|WITH)\b", re.IGNORECASE)
_instrumented = False
_lock = threading.Lock()


class SqlState(TypedDict, total=False):
    question: str
    query: str
    result: str
    verdict: str
    rewrites: int


def instrument_once() -> None:
    global _instrumented
    with _lock:
        if not _instrumented:
            LangChainInstrumentor().instrument()
            _instrumented = True


def extract_sql(text: str) -> str:
    """The query in a model's reply: inside a code fence if any, from the first SELECT/WITH, up to a ';'."""
    fenced = _FENCE.search(text or "")
    body = fenced.group(1) if fenced else (text or "")
    start = _START.search(body)
    if start is None:
        return body.strip()
    return body[start.start() :].split(";")[0].strip()


def write_request(schema: str, question: str) -> str:
    """What ``write`` is asked: the database's tables and the question."""
    return f"Tables:\n{schema}\nQuestion: {question}"


def rewrite_request(schema: str, state: SqlState) -> str:
    """What ``rewrite`` is asked: the tables, the question, the query, its result and the checker's review."""
    return (
        f"Tables:\n{schema}\nQuestion: {state['question']}\nQuery: {state['query'][:300]}\n"
        f"Result: {state['result']}\nReview: {state['verdict']}"
    )


def _show(path: Path, query: str) -> str:
    outcome = run_query(path, query)
    if outcome.rows is None:
        return f"error: {outcome.error}"
    return f"{len(outcome.rows)} rows, first: {outcome.rows[:3]}"[:200]


NODES = ("write", "check", "rewrite")


def build_graph(chats: dict[str, ChatOpenAI], db: str | None = None) -> Any:
    """The graph on database ``db`` (None: the shop); ``chats``: each node's chat model."""
    schema, path = schema_text(db), database_path(db)

    def ask(node: str, system: str, user: str) -> str:
        reply = chats[node].invoke([SystemMessage(system), HumanMessage(user)])
        return reply.content if isinstance(reply.content, str) else str(reply.content)

    def write(state: SqlState) -> SqlState:
        query = extract_sql(ask("write", WRITE, write_request(schema, state["question"])))
        return {"query": query, "result": _show(path, query), "rewrites": 0}

    def check(state: SqlState) -> SqlState:
        user = f"Question: {state['question']}\nQuery: {state['query'][:300]}\nResult: {state['result']}"
        return {"verdict": ask("check", CHECK, user)[:300]}

    def rewrite(state: SqlState) -> SqlState:
        query = extract_sql(ask("rewrite", REWRITE, rewrite_request(schema, state)))
        return {"query": query, "result": _show(path, query), "rewrites": state.get("rewrites", 0) + 1}

    def after_check(state: SqlState) -> str:
        done = state["verdict"].strip().upper().startswith("OK") or state.get("rewrites", 0) >= MAX_REWRITES
        return END if done else "rewrite"

    graph = StateGraph(SqlState)
    graph.add_node("write", write)
    graph.add_node("check", check)
    graph.add_node("rewrite", rewrite)
    graph.add_edge(START, "write")
    graph.add_edge("write", "check")
    graph.add_conditional_edges("check", after_check, ["rewrite", END])
    graph.add_edge("rewrite", "check")
    return graph.compile(name="sql_agent")


def run(task: dict[str, Any], llm: Any) -> float:
    """One episode on ``task["question"]`` over ``task["db"]`` (absent: the shop); 1.0 when the final query returns
    what ``task["gold_sql"]`` returns there."""
    instrument_once()
    chats = {
        node: ChatOpenAI(
            base_url=llm.for_agent(node).base_url,
            api_key=llm.api_key,
            model=llm.model,
            max_retries=0,
            timeout=300,
            max_tokens=int(task.get("max_tokens", DEFAULT_MAX_TOKENS)),
            temperature=0.0 if task.get("greedy") else 1.0,
        )
        for node in NODES
    }
    db = None if task.get("db") is None else str(task["db"])
    state = build_graph(chats, db).invoke({"question": str(task["question"])}, {"recursion_limit": 20})
    return reward(database_path(db), state.get("query", ""), str(task["gold_sql"]))
