"""Find what each feedback scores in the store: the call behind a response id, a rollout's latest attempt, a trace's
rollout. One query answers a whole round of feedback (never one query per record).

What a target resolves to (the ``feedback`` table's RolloutId, Attempt, TraceId and SpanId; see its DDL):

* ``response``: the spans whose ``gen_ai.response.id`` is the id. The LLM calls among them (spans with response
  token ids, which the LLM gateway records) are what transitions are built from, so those are kept: one per choice
  when a request asked for ``n`` > 1 (the choices share the id). When none of them has token ids (an ``openai``
  upstream, or only the agent's own instrumentation recorded the id), the earliest span with the id is kept.
* ``rollout``: the rollout's latest attempt in the rollouts table; no trace, no span (the whole episode).
* ``trace``: the rollout that the trace's spans carry (the highest attempt among them); for a trace that no rollout
  owns but that holds LLM calls with token ids, its production rollout (``trace-<trace id>``, attempt 1: see
  :mod:`fulmen.consumers.production`); else none ('' and 0); no span (the whole episode).

A call that no rollout owns (an agent Fulmen does not run) belongs to the production rollout of its trace, so a
response id resolves to that rollout too, and replay, which joins feedback to transitions by rollout and span, finds
it. The production rollout does not need to exist yet (its trace may still be open): its id is the trace's.

A target with nothing in the store is missing from the answer. Reads deduplicate (``FINAL``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fulmen.infra.store import Store
from fulmen.schemas import semconv
from fulmen.schemas.ddl import TABLES
from fulmen.schemas.events import PRODUCTION_ROLLOUT_PREFIX, FeedbackTarget

__all__ = ["Resolved", "Target", "TargetResolver"]

Target = tuple[FeedbackTarget, str]
"""(what kind of id, the id)."""


@dataclass(frozen=True)
class Resolved:
    """One call or episode a feedback scores (``span_id`` empty: the whole episode)."""

    rollout_id: str
    attempt: int
    trace_id: str
    span_id: str


# Each part answers (Kind, Id, RolloutId, Attempt, TraceId, SpanId, IsCall, StartNs); only the parts a round needs
# are sent, joined by UNION ALL. __SPANS__ and __ROLLOUTS__ are our table names (the database name is validated);
# __PRODUCTION__ is the production rollout id prefix, and __CALL__ what makes a span an LLM call with token ids.
_PARTS = {
    FeedbackTarget.RESPONSE: """
SELECT 'response', SpanAttributes[{response_key:String}],
       if(RolloutId = '' AND __CALL__, concat('__PRODUCTION__', TraceId), RolloutId),
       if(RolloutId = '' AND __CALL__, toUInt32(1), Attempt), TraceId, SpanId,
       toUInt8(length(ResponseTokenIds) > 0), toUnixTimestamp64Nano(Timestamp)
FROM __SPANS__
WHERE SpanAttributes[{response_key:String}] IN {response_ids:Array(String)}""",
    FeedbackTarget.ROLLOUT: """
SELECT 'rollout', RolloutId, RolloutId, max(Attempt), '', '', toUInt8(0), toInt64(0)
FROM __ROLLOUTS__
WHERE RolloutId IN {rollout_ids:Array(String)}
GROUP BY RolloutId""",
    FeedbackTarget.TRACE: """
SELECT 'trace', TraceId,
       if(countIf(RolloutId != '') = 0 AND countIf(__CALL__) > 0, concat('__PRODUCTION__', TraceId),
          argMaxIf(RolloutId, Attempt, RolloutId != '')),
       if(countIf(RolloutId != '') = 0 AND countIf(__CALL__) > 0, toUInt32(1), maxIf(Attempt, RolloutId != '')),
       TraceId, '', toUInt8(0), toInt64(0)
FROM __SPANS__
WHERE TraceId IN {trace_ids:Array(String)}
GROUP BY TraceId""",
}
_CALL = "(length(PromptTokenIds) > 0 AND length(ResponseTokenIds) > 0)"
_PARAMETER = {
    FeedbackTarget.RESPONSE: "response_ids",
    FeedbackTarget.ROLLOUT: "rollout_ids",
    FeedbackTarget.TRACE: "trace_ids",
}


class TargetResolver:
    """Resolves targets through a :class:`Store` (blocking: call it from a worker thread)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        spans, rollouts = store.table(TABLES["spans"]), store.table(TABLES["rollouts"])
        self._parts = {
            kind: sql.replace("__SPANS__", spans)
            .replace("__ROLLOUTS__", rollouts)
            .replace("__CALL__", _CALL)
            .replace("__PRODUCTION__", PRODUCTION_ROLLOUT_PREFIX)
            for kind, sql in _PARTS.items()
        }

    def resolve(self, targets: Iterable[Target]) -> dict[Target, list[Resolved]]:
        """What each of ``targets`` scores (a target not in the store is missing from the result)."""
        wanted: dict[FeedbackTarget, set[str]] = defaultdict(set)
        for kind, target_id in targets:
            wanted[FeedbackTarget(kind)].add(target_id)
        if not wanted:
            return {}
        kinds = [kind for kind in FeedbackTarget if wanted.get(kind)]
        sql = "\nUNION ALL".join(self._parts[kind] for kind in kinds)
        parameters: dict[str, Any] = {_PARAMETER[kind]: sorted(wanted[kind]) for kind in kinds}
        if FeedbackTarget.RESPONSE in wanted:
            parameters["response_key"] = semconv.GEN_AI_RESPONSE_ID
        rows = self.store.query(sql, parameters, final=True).rows
        return _chosen(rows)


def _chosen(rows: list[Any]) -> dict[Target, list[Resolved]]:
    """The rows of the query, grouped by target, with a response's spans narrowed to its calls (module docstring)."""
    found: dict[Target, list[tuple[bool, int, Resolved]]] = defaultdict(list)
    for kind, target_id, rollout_id, attempt, trace_id, span_id, is_call, start_ns in rows:
        resolved = Resolved(rollout_id, int(attempt), trace_id, span_id)
        found[(FeedbackTarget(kind), target_id)].append((bool(is_call), int(start_ns), resolved))
    chosen = {}
    for target, candidates in found.items():
        candidates.sort(key=lambda c: (c[1], c[2].trace_id, c[2].span_id))  # in the order the spans started
        calls = [resolved for is_call, _, resolved in candidates if is_call]
        chosen[target] = calls or [candidates[0][2]]
    return chosen
