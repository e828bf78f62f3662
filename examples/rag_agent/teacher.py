"""The RAG agent's teacher: what a perfect model answers at each call (``fulmen.warmup``).

One search per hop, then the answer. Each search names the title of the next page on the question's gold path:
the entity the question names, then the entity the previous page led to (the town, the river; the company, the
port...), whatever the template. Every title is written in the page before it, and searching a title finds its
page first (:mod:`examples.rag_agent.search`), so the searches are the ones that find the gold documents.
"""

from __future__ import annotations

import json
from typing import Any

from examples.rag_agent.corpus import corpus
from fulmen.testing import Reply, ToolCall

__all__ = ["queries", "teach"]


def queries(task: dict[str, Any]) -> list[str]:
    """The searches a perfect model makes for ``task``: the titles of its gold documents, in order."""
    titles = corpus().titles
    unknown = [doc_id for doc_id in task["gold_docs"] if doc_id not in titles]
    if unknown:
        raise ValueError(f"the task's gold documents {unknown} are not in the corpus: {task['question']!r}")
    return [titles[doc_id] for doc_id in task["gold_docs"]]


def teach(task: dict[str, Any], messages: list[dict[str, Any]]) -> Reply:
    searches = queries(task)
    searched = sum(message.get("role") == "tool" for message in messages)
    if searched < len(searches):
        return Reply(tool_calls=(ToolCall("search", json.dumps({"query": searches[searched]})),))
    return Reply(content=str(task["answer"]))
