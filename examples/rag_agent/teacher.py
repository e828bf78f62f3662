"""The RAG agent's teacher: what a perfect model answers at each call (``fulmen.warmup``).

One search per hop, each naming the entity the previous document led to (the person, then the town they were
born in, then, for three hops, the river through that town), then the answer. The facts come from the corpus
itself (:func:`examples.rag_agent.data.corpus`), so the searches are the ones that find the gold documents.
"""

from __future__ import annotations

import json
from typing import Any

from examples.rag_agent.data import corpus, person_of
from fulmen.testing import Reply, ToolCall

__all__ = ["teach"]


def teach(task: dict[str, Any], messages: list[dict[str, Any]]) -> Reply:
    facts = corpus()
    person = person_of(task["question"])
    town = facts.born_in[person]
    river = facts.river_of[town]
    queries = [person, town, river.removeprefix("the ")][: int(task["hops"])]
    searched = sum(message.get("role") == "tool" for message in messages)
    if searched < len(queries):
        return Reply(tool_calls=(ToolCall("search", json.dumps({"query": queries[searched]})),))
    return Reply(content=str(task["answer"]))
