"""Read rollouts' spans from the store for the transitions consumer (one query for many rollouts).

Spans belong to a rollout attempt by their typed columns ``RolloutId`` and ``Attempt`` (the runner stamps every
span the agent makes, the LLM gateway stamps its own from the request path). Reads deduplicate (``FINAL``): a
span Kafka delivered twice is one span. Only the columns the builder needs are read, and of the attribute map
only :data:`EXTRA_ATTRIBUTES`.

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

__all__ = ["EXTRA_ATTRIBUTES", "RolloutKey", "SpanReader"]

RolloutKey = tuple[str, int]
"""(rollout id, attempt)."""

EXTRA_ATTRIBUTES = (semconv.OPENINFERENCE_METADATA, semconv.GEN_AI_RESPONSE_ID)
"""The span attributes the selection reads besides the typed columns."""

_SPANS_SQL = """
SELECT RolloutId, Attempt, TraceId, SpanId, ParentSpanId, SpanName, toUnixTimestamp64Nano(Timestamp), Duration,
       AgentName, ModelVersion, PromptTokenIds, ResponseTokenIds, ResponseLogprobs, Reward,
       SpanAttributes[{meta:String}], SpanAttributes[{response_id:String}],
       arrayMap(t -> toUnixTimestamp64Nano(t), `Events.Timestamp`),
       arrayMap(a -> a[{reward_a:String}], `Events.Attributes`),
       arrayMap(a -> a[{reward_b:String}], `Events.Attributes`),
       `Links.TraceId`, `Links.SpanId`,
       arrayMap(a -> a[{response_id:String}], `Events.Attributes`)
FROM __TABLE__
WHERE (RolloutId, Attempt) IN {keys:Array(Tuple(String, UInt32))}
"""

_COUNTS_SQL = """
SELECT RolloutId, Attempt, uniqExact(TraceId, SpanId)
FROM __TABLE__
WHERE (RolloutId, Attempt) IN {keys:Array(Tuple(String, UInt32))}
GROUP BY RolloutId, Attempt
"""

# The rollout ids narrow the scan to their ranges of the sort key, so the check costs what the watched rollouts
# hold, not what the table holds.
_RECENT_SQL = """
SELECT DISTINCT RolloutId, Attempt
FROM __TABLE__
WHERE RolloutId IN {ids:Array(String)} AND IngestedAt >= fromUnixTimestamp64Milli({since_ms:Int64}, 'UTC')
"""


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
        wanted = sorted(set(keys))
        if not wanted:
            return {}
        reward_a, reward_b = semconv.REWARD_KEYS
        parameters = {
            "keys": wanted, "meta": semconv.OPENINFERENCE_METADATA,
            "response_id": semconv.GEN_AI_RESPONSE_ID, "reward_a": reward_a, "reward_b": reward_b,
        }  # fmt: skip
        rows = self.store.query(self._spans_sql, parameters, final=True).rows
        found: dict[RolloutKey, list[SpanRecord]] = defaultdict(list)
        for row in rows:
            found[(row[0], int(row[1]))].append(_record(row))
        return dict(found)

    def span_counts(self, keys: Iterable[RolloutKey]) -> dict[RolloutKey, int]:
        """How many distinct spans (trace id, span id) each rollout attempt has now."""
        wanted = sorted(set(keys))
        if not wanted:
            return {}
        rows = self.store.query(self._counts_sql, {"keys": wanted}, final=False).rows
        return {(row[0], int(row[1])): int(row[2]) for row in rows}

    def now_ms(self) -> int:
        """The store's clock (which fills ``IngestedAt``), in milliseconds since the epoch."""
        return int(self.store.query("SELECT toUnixTimestamp64Milli(now64(3))", final=False).rows[0][0])

    def recently_ingested(self, rollout_ids: Iterable[str], since_ms: int) -> set[RolloutKey]:
        """The attempts of ``rollout_ids`` that received a span at or after ``since_ms`` (store clock, ms since
        the epoch)."""
        ids = sorted(set(rollout_ids))
        if not ids:
            return set()
        rows = self.store.query(self._recent_sql, {"ids": ids, "since_ms": since_ms}, final=False).rows
        return {(row[0], int(row[1])) for row in rows}


def _record(row: Sequence[Any]) -> SpanRecord:
    start = int(row[6])
    rewarded = [
        ((int(at), value), response_id)
        for at, first, second, response_id in zip(row[16], row[17], row[18], row[21], strict=True)
        if (value := _number(first) if first else _number(second)) is not None
    ]
    return SpanRecord(
        trace_id=row[2], span_id=row[3], parent_span_id=row[4], name=row[5], start_ns=start,
        end_ns=start + int(row[7]), agent_name=row[8],
        attributes={k: v for k, v in zip(EXTRA_ATTRIBUTES, (row[14], row[15]), strict=True) if v},
        prompt_token_ids=tuple(row[10]), response_token_ids=tuple(row[11]),
        response_logprobs=tuple(float(x) for x in row[12]),
        model_version=int(row[9]) if row[9] is not None else None, reward=row[13],
        event_rewards=tuple(reward for reward, _ in rewarded),
        event_response_ids=tuple(response_id for _, response_id in rewarded),
        links=tuple(zip(row[19], row[20], strict=True)),
    )  # fmt: skip


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None
