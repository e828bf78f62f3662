"""What went wrong in a RAG episode, read from what the model wrote at each call (the gateway's spans).

Each ``search`` the model asked for is run again (the index is deterministic), so the kind says how far along the
question's gold path the episode got. Kinds, checked in this order: ``correct``; ``timed_out`` / ``failed`` (the
rollout did not finish); ``no_search`` (the model answered, or wrote nothing, without searching); then, when the
searches did not reach every page on the path: ``out_of_turns`` (no final answer: the turn limit came first),
``lost_path`` (a search found none of the path's pages still to read: the chain broke there) or ``answered_early``
(every search found the next page, but the model answered before the last hop); when they did reach every page:
``no_answer`` (the turns ran out after the last page) or ``wrong_answer`` (the facts were in front of it).
"""

from __future__ import annotations

from typing import Any

from examples.outcomes import Episode, argument_of_calls, generic_failure_kind
from examples.rag_agent.search import search

__all__ = ["KINDS", "failure_kind"]

KINDS = (
    "correct",
    "timed_out",
    "failed",
    "no_search",
    "out_of_turns",
    "lost_path",
    "answered_early",
    "no_answer",
    "wrong_answer",
)


def failure_kind(task: dict[str, Any], episode: Episode) -> str:
    """The kind of ``episode``'s outcome on ``task`` (module docstring)."""
    finished = generic_failure_kind(task, episode)
    if finished != "wrong":  # solved, or the rollout did not finish
        return finished
    queries = [q for message in episode.outputs for q in argument_of_calls(message, "query")]
    if not queries:
        return "no_search"
    gold = list(task["gold_docs"])
    found: set[str] = set()
    broke = False
    for query in queries:
        hits = {doc_id for doc_id, _ in search(query)}
        if not hits & (set(gold) - found):
            broke = True
        found |= hits
    answered = any(not m.get("tool_calls") and (m.get("content") or "").strip() for m in episode.outputs[-1:])
    if set(gold) <= found:
        return "wrong_answer" if answered else "no_answer"
    if not answered:
        return "out_of_turns"
    return "lost_path" if broke else "answered_early"
