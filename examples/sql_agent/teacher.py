"""The SQL agent's teacher: what a perfect model answers at each node (``fulmen.warmup``).

``write`` answers with the gold query, except on every third question (by a hash of its text), where it writes
the gold query against a table that does not exist, so that the demonstrations show the whole graph: ``check``
sees the error and says what is wrong, ``rewrite`` answers with the gold query, ``check`` says ``OK``. The node
is told apart by its system prompt (the agent's ``WRITE`` / ``CHECK`` / ``REWRITE``: the same text on every
database, the schema being in the user message); the gold query is the task's, on the task's database.
"""

from __future__ import annotations

import zlib
from typing import Any

from examples.sql_agent.agent import CHECK, REWRITE, WRITE
from fulmen.testing import Reply

__all__ = ["teach"]


def _broken(gold: str) -> str:
    """The gold query against a misspelt table: it fails, and the checker must say so."""
    return gold.replace(" FROM ", " FROM x_", 1)


def teach(task: dict[str, Any], messages: list[dict[str, Any]]) -> Reply:
    system = next((m.get("content") for m in messages if m.get("role") == "system"), "")
    user = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "") or ""
    gold = str(task["gold_sql"])
    if system == WRITE:
        stumble = zlib.crc32(str(task["question"]).encode()) % 3 == 0
        return Reply(content=_broken(gold) if stumble else gold)
    if system == REWRITE:
        return Reply(content=gold)
    if system == CHECK:
        return Reply(content="OK" if "Result: error" not in user else "The query fails: a table name is wrong.")
    raise ValueError(f"the SQL teacher does not know this prompt: {system[:80]!r}")
