"""Read rollouts' spans from the store for the transitions consumer (one query for many rollouts).

Spans belong to a rollout attempt by their typed columns ``RolloutId`` and ``Attempt`` (the runner stamps every
span the agent makes, the LLM gateway stamps its own from the request path). A production rollout (``trace-<trace
id>``, attempt 1: an agent Fulmen does not run, see :mod:`fulmen.consumers.production`) has no stamped span: its
spans are those of its trace that no rollout stamped (``RolloutId`` ''). Reads deduplicate (``FINAL``): a span
Kafka delivered twice is one span. Only the columns the builder needs are read, and of the attribute map only
:data:`EXTRA_ATTRIBUTES`.

:meth:`SpanReader.recently_ingested` and :meth:`SpanReader.span_counts` serve the late-span check: which
rollouts received spans since a moment of the store's clock, and how many distinct spans each has now.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from fulmen.consumers.transitions.tree import SpanRecord
from fulmen.infra.store import Store
from fulmen.schemas import semconv
from fulmen.schemas.ddl import TABLES
from fulmen.schemas.events import production_trace_id

__all__ = ["EXTRA_ATTRIBUTES", "RolloutKey", "SpanReader", "span_record"]

RolloutKey = tuple[str, int]
"""(rollout id, attempt)."""

EXTRA_ATTRIBUTES = (semconv.OPENINFERENCE_METADATA, semconv.GEN_AI_RESPONSE_ID, semconv.PROMPT_BUNDLE)
"""The span attributes the selection reads besides the typed columns."""

_SPANS_SQL = """
SELECT RolloutId, Attempt, TraceId, SpanId, ParentSpanId, SpanName, toUnixTimestamp64Nano(Timestamp), Duration,
       AgentName, ModelVersion, PromptTokenIds, ResponseTokenIds, ResponseLogprobs, Reward,
       SpanAttributes[{meta:String}], SpanAttributes[{response_id:String}],
       arrayMap(t -> toUnixTimestamp64Nano(t), `Events.Timestamp`),
       arrayMap(a -> a[{reward_a:String}], `Events.Attributes`),
       arrayMap(a -> a[{reward_b:String}], `Events.Attributes`),
       `Links.TraceId`, `Links.SpanId`,
       arrayMap(a -> a[{response_id:String}], `Events.Attributes`),
       SpanAttributes[{bundle:String}]
FROM __TABLE__
WHERE __WHERE__
"""

# A production rollout's spans are found by (RolloutId '', TraceId): a range of the sort key, like a rollout's. Each
# query answers the trace (TraceId where RolloutId is '') so its rows are told apart from the stamped ones.
_COUNTS_SQL = """
SELECT RolloutId, Attempt, if(RolloutId = '', TraceId, ''), uniqExact(TraceId, SpanId)
FROM __TABLE__
WHERE __WHERE__
GROUP BY RolloutId, Attempt, if(RolloutId = '', TraceId, '')
"""

# The rollout ids (and traces) narrow the scan to their ranges of the sort key, so the check costs what the watched
# rollouts hold, not what the table holds.
_RECENT_SQL = """
SELECT DISTINCT RolloutId, Attempt, if(RolloutId = '', TraceId, '')
FROM __TABLE__
WHERE (__WHERE__) AND IngestedAt >= fromUnixTimestamp64Milli({since_ms:Int64}, 'UTC')
"""

_STAMPED = "(RolloutId, Attempt) IN {keys:Array(Tuple(String, UInt32))}"
_STAMPED_IDS = "RolloutId IN {ids:Array(String)}"
_UNSTAMPED = "(RolloutId = '' AND TraceId IN {traces:Array(String)})"


class SpanReader:
    """Reads through a :class:`Store` (blocking: call it from a worker thread)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.table = store.table(TABLES["spans"])  # database name validated by the settings: safe to inline
        self._spans_sql, self._counts_sql, self._recent_sql = (
            sql.replace("__TABLE__", self.table) for sql in (_SPANS_SQL, _COUNTS_SQL, _RECENT_SQL)
        )
        if len(semconv.REWARD_KEYS) != 2:
            raise ValueError("the span query reads exactly two reward keys from events; update _SPANS_SQL")

    def spans(self, keys: Iterable[RolloutKey]) -> dict[RolloutKey, list[SpanRecord]]:
        """The spans of each rollout attempt in ``keys`` (missing from the result: no span at all)."""
        where, parameters, traces = _where(keys)
        if not where:
            return {}
        reward_a, reward_b = semconv.REWARD_KEYS
        parameters |= {
            "meta": semconv.OPENINFERENCE_METADATA,
            "response_id": semconv.GEN_AI_RESPONSE_ID,
            "reward_a": reward_a,
            "reward_b": reward_b,
            "bundle": semconv.PROMPT_BUNDLE,
        }
        rows = self.store.query(self._spans_sql.replace("__WHERE__", where), parameters, final=True).rows
        found: dict[RolloutKey, list[SpanRecord]] = defaultdict(list)
        for row in rows:
            found[traces[row[2]] if row[0] == "" else (row[0], int(row[1]))].append(_record(row))
        return dict(found)

    def span_counts(self, keys: Iterable[RolloutKey]) -> dict[RolloutKey, int]:
        """How many distinct spans (trace id, span id) each rollout attempt has now."""
        where, parameters, traces = _where(keys)
        if not where:
            return {}
        rows = self.store.query(self._counts_sql.replace("__WHERE__", where), parameters, final=False).rows
        return {traces[row[2]] if row[0] == "" else (row[0], int(row[1])): int(row[3]) for row in rows}

    def now_ms(self) -> int:
        """The store's clock (which fills ``IngestedAt``), in milliseconds since the epoch."""
        return int(self.store.query("SELECT toUnixTimestamp64Milli(now64(3))", final=False).rows[0][0])

    def recently_ingested(self, rollout_ids: Iterable[str], since_ms: int) -> set[RolloutKey]:
        """The attempts of ``rollout_ids`` that received a span at or after ``since_ms`` (store clock, ms since
        the epoch)."""
        ids = set(rollout_ids)
        traces = {trace: (rollout_id, 1) for rollout_id in ids if (trace := production_trace_id(rollout_id))}
        stamped = sorted(ids.difference(key[0] for key in traces.values()))
        where, parameters = _condition(_STAMPED_IDS, "ids", stamped, traces)
        if not where:
            return set()
        sql = self._recent_sql.replace("__WHERE__", where)
        rows = self.store.query(sql, parameters | {"since_ms": since_ms}, final=False).rows
        return {traces[row[2]] if row[0] == "" else (row[0], int(row[1])) for row in rows}


def _where(keys: Iterable[RolloutKey]) -> tuple[str, dict[str, Any], dict[str, RolloutKey]]:
    """The condition that finds the spans of ``keys``, its parameters, and the production keys by trace id (a
    production rollout's attempt is always 1). The condition is '' when ``keys`` is empty."""
    wanted = set(keys)
    traces = {trace: key for key in wanted if (trace := production_trace_id(key[0])) is not None and key[1] == 1}
    stamped = sorted(wanted.difference(traces.values()))
    return *_condition(_STAMPED, "keys", stamped, traces), traces


def _condition(clause: str, name: str, stamped: list[Any], traces: Iterable[str]) -> tuple[str, dict[str, Any]]:
    """``clause`` (its parameter ``name`` is ``stamped``) or the unstamped spans of ``traces``, whichever are
    wanted, and the parameters; '' when neither is."""
    parts, parameters = [], {}
    if stamped:
        parts.append(clause)
        parameters[name] = stamped
    if traces := sorted(traces):
        parts.append(_UNSTAMPED)
        parameters["traces"] = traces
    return " OR ".join(parts), parameters


def _record(row: Sequence[Any]) -> SpanRecord:
    """A row of ``_SPANS_SQL``."""
    return span_record(
        row[2:10],
        row[10],
        row[11],
        row[12],
        row[13],
        attributes=(row[14], row[15], row[22]),
        events=(row[16], row[17], row[18], row[21]),
        links=(row[19], row[20]),
    )


def span_record(
    head: Sequence[Any],
    prompt: Iterable[int],
    response: Iterable[int],
    logprobs: Iterable[float],
    reward: float | None,
    *,
    attributes: Sequence[str],
    events: tuple[Sequence[int], Sequence[str], Sequence[str], Sequence[str]],
    links: tuple[Sequence[str], Sequence[str]],
) -> SpanRecord:
    """A :class:`SpanRecord` from what the store answers (or what the span feed holds: ``transitions.feed``).
    ``head`` is (trace id, span id, parent span id, name, start ns, duration ns, agent name, model version|None);
    ``attributes`` the texts of :data:`EXTRA_ATTRIBUTES`; ``events`` each event's start ns, its texts of the two
    reward keys, and its response id text; ``links`` the linked trace ids and span ids."""
    trace_id, span_id, parent_span_id, name, start, duration, agent_name, model_version = head
    start = int(start)
    times, first_rewards, second_rewards, response_ids = events
    rewarded = [
        ((int(at), value), response_id)
        for at, first, second, response_id in zip(times, first_rewards, second_rewards, response_ids, strict=True)
        if (value := _number(first) if first else _number(second)) is not None
    ]
    return SpanRecord(
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=parent_span_id,
        name=name,
        start_ns=start,
        end_ns=start + int(duration),
        agent_name=agent_name,
        attributes={k: v for k, v in zip(EXTRA_ATTRIBUTES, attributes, strict=True) if v},
        prompt_token_ids=tuple(prompt),
        response_token_ids=tuple(response),
        response_logprobs=tuple(float(x) for x in logprobs),
        model_version=int(model_version) if model_version is not None else None,
        reward=reward,
        event_rewards=tuple(reward for reward, _ in rewarded),
        event_response_ids=tuple(response_id for _, response_id in rewarded),
        links=tuple(zip(*links, strict=True)),
    )


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None
