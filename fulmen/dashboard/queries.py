"""What the dashboard shows, as read-only SQL over the store: runs and their steps, rollouts, one rollout's
trace, model versions and which one serves, prompt bundles and their scores, dead letters.

Every query goes through a reader of the read-only surface (:class:`~fulmen.infra.store.RemoteReader` to the
endpoint ``fulmen consume`` serves, or :class:`~fulmen.infra.store.Store` on a ClickHouse server, always with
``read_only=True``), so the SQL guard checks each statement and the read limits bound it. Values from the
browser never become SQL text: :func:`parse_filters` validates them (enums, identifiers, bounded integers;
a bad one is a :class:`FilterError` naming it) and they travel as ``%(name)s`` parameters, which the reader
binds with clickhouse-connect's quoting before the guard sees the statement. The SQL text itself is fixed
here: a filter that is absent selects a clause that is always true, not a different string.

Results come back as JSON-ready dicts (timestamps as ISO 8601, NaN and infinities as None).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from fulmen.algorithm.rl.credit import CREDIT_STRATEGIES, assign_credit
from fulmen.prompt_queries import bundle_rewards, bundle_rows, serving_by_scope
from fulmen.schemas import semconv
from fulmen.schemas.errors import FulmenError
from fulmen.schemas.events import RolloutMode, RolloutStatus
from fulmen.versions import model_names, rollout_versions, version_label, version_rows

__all__ = ["DashboardQueries", "FilterError", "Reader", "RolloutFilters", "jsonable", "parse_filters"]

_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_MAX_PAGE = 500
_SLOT_CHARS = 200  # of each bundle slot's text on the Prompts page
_MESSAGE_CHARS = 20_000  # of each call's prompt and response messages shown
_ATTRIBUTE_CHARS = 500  # of every other span attribute


class FilterError(FulmenError):
    """A query parameter from the browser that is not valid; the message names it (answered with a 400)."""


class Reader(Protocol):
    def query(self, sql: str, parameters: Any = None, *, final: bool = True, read_only: bool = True) -> Any: ...


@dataclass(frozen=True)
class RolloutFilters:
    status: str = ""
    mode: str = ""
    run: str = ""
    attempt: int = 0  # 0 = any
    limit: int = 50
    offset: int = 0


def _choice(params: Mapping[str, str], name: str, allowed: list[str]) -> str:
    value = params.get(name, "")
    if value and value not in allowed:
        raise FilterError(f"{name} must be one of {', '.join(allowed)}, not {value[:40]!r}")
    return value


def _identifier(params: Mapping[str, str], name: str, *, required: bool = False) -> str:
    value = params.get(name, "")
    if (value or required) and not _ID.match(value):
        raise FilterError(f"{name} must be 1-128 letters, digits or ._:- (got {value[:40]!r})")
    return value


def _integer(params: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    text = params.get(name, "")
    if not text:
        return default
    if not text.isdigit() or not low <= int(text) <= high:
        raise FilterError(f"{name} must be an integer from {low} to {high}, not {text[:40]!r}")
    return int(text)


def parse_filters(params: Mapping[str, str]) -> RolloutFilters:
    """The rollouts page's filters from its query string; :class:`FilterError` for one that is not valid."""
    return RolloutFilters(
        status=_choice(params, "status", [s.value for s in RolloutStatus]),
        mode=_choice(params, "mode", [m.value for m in RolloutMode]),
        run=_identifier(params, "run"),
        attempt=_integer(params, "attempt", 0, 0, 100),
        limit=_integer(params, "limit", 50, 1, _MAX_PAGE),
        offset=_integer(params, "offset", 0, 0, 10_000_000),
    )


def jsonable(value: Any) -> Any:
    """``value`` as JSON can carry it: ISO timestamps, None for NaN and infinities, lists for tuples."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def _records(result: Any) -> list[dict[str, Any]]:
    return [jsonable(dict(zip(result.columns, row, strict=True))) for row in result.rows]


_RUNS = """
SELECT RunId, count() AS Steps, max(Step) AS LastStep, max(ModelVersion) AS LastVersion,
       min(CreatedAt - toIntervalMillisecond(toUInt64((RolloutWaitS + TrainS + PublishS) * 1000))) AS StartedAt,
       max(CreatedAt) AS LastAt, argMax(RewardMean, Step) AS LastReward
FROM train_steps GROUP BY RunId ORDER BY StartedAt DESC LIMIT 200
"""

_STEPS = """
SELECT Step, ModelVersion, RewardMean, RewardStd, if(mapContains(Extra, 'val_accuracy'), Extra['val_accuracy'], NULL)
       AS HeldOut, Loss, Kl, ClipFraction, TokensPerS, NumTransitions, NumGroups, TrainS, RolloutWaitS, CreatedAt
FROM train_steps WHERE RunId = %(run)s AND Step > %(after)s ORDER BY Step LIMIT 100000
"""

_VERSIONS = """
SELECT ModelName, Version, Step, Format, Uri, CreatedAt FROM model_versions
WHERE RunId = %(run)s ORDER BY Version
"""

# A fixed text: each filter's clause is true when the filter is empty.
_WHERE = """
WHERE (%(status)s = '' OR Status = %(status)s) AND (%(mode)s = '' OR Mode = %(mode)s)
  AND (%(attempt)s = 0 OR Attempt = %(attempt)s)
  AND (%(run)s = '' OR (Timestamp >= toDateTime64(%(run_from)s, 6, 'UTC')
                        AND Timestamp < toDateTime64(%(run_to)s, 6, 'UTC')))
"""

_ROLLOUTS = f"""
SELECT RolloutId, Attempt, TaskId, GroupId, Mode, Status, Reward, Error, RunnerId, ModelVersion, Timestamp
FROM rollouts {_WHERE} ORDER BY Timestamp DESC, RolloutId, Attempt LIMIT %(limit)s OFFSET %(offset)s
"""

_ROLLOUT_COUNTS = f"SELECT Status, count() AS N FROM rollouts {_WHERE} GROUP BY Status ORDER BY Status"

_ATTEMPTS = """
SELECT RolloutId, Attempt, TaskId, GroupId, Mode, Status, Reward, Error, RunnerId, ModelVersion, Timestamp
FROM rollouts WHERE RolloutId = %(id)s ORDER BY Attempt
"""

_SPANS = f"""
SELECT SpanId, ParentSpanId, TraceId, SpanName, SpanKind, ServiceName, ScopeName, AgentName, Timestamp,
       Duration, StatusCode, StatusMessage, ModelVersion, Reward,
       length(PromptTokenIds) AS PromptTokens, length(ResponseTokenIds) AS ResponseTokens,
       substring(SpanAttributes['{semconv.GEN_AI_INPUT_MESSAGES}'], 1, {_MESSAGE_CHARS}) AS InputMessages,
       substring(SpanAttributes['{semconv.GEN_AI_OUTPUT_MESSAGES}'], 1, {_MESSAGE_CHARS}) AS OutputMessages,
       mapApply((k, v) -> (k, substring(v, 1, {_ATTRIBUTE_CHARS})),
                mapFilter((k, v) -> k NOT IN ('{semconv.GEN_AI_INPUT_MESSAGES}', '{semconv.GEN_AI_OUTPUT_MESSAGES}'),
                          SpanAttributes)) AS Attributes
FROM otel_traces WHERE RolloutId = %(id)s AND Attempt = %(attempt)s ORDER BY Timestamp, SpanId LIMIT 5000
"""

_TRANSITIONS = """
SELECT CallIndex, SpanId, AgentName, ModelVersion, length(PromptTokenIds) AS PromptTokens,
       length(ResponseTokenIds) AS ResponseTokens, IntermediateReward, EpisodeReward
FROM transitions WHERE RolloutId = %(id)s AND Attempt = %(attempt)s ORDER BY CallIndex
"""

_DEAD_LETTERS = """
SELECT Topic, Partition, Offset, SourceTopic, SourcePartition, SourceOffset, ErrorType, Error, ConsumerGroup,
       FailedAt, Key, substring(ValuePreview, 1, 300) AS ValuePreview, ValueBytes
FROM dead_letters ORDER BY FailedAt DESC, Offset DESC LIMIT %(limit)s
"""

_DEAD_LETTER_COUNT = "SELECT count() AS N FROM dead_letters"


class DashboardQueries:
    """The dashboard's reads over one reader (see the module docstring). Each method runs blocking I/O."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader

    def _rows(self, sql: str, parameters: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        return _records(self.reader.query(sql, dict(parameters or {}), final=True, read_only=True))

    # --- runs -------------------------------------------------------------------------------------------
    def runs(self) -> list[dict[str, Any]]:
        return self._rows(_RUNS)

    def steps(self, params: Mapping[str, str]) -> dict[str, Any]:
        run = _identifier(params, "run", required=True)
        after = _integer(params, "after", -1, 0, 10**12) if params.get("after") else -1
        steps = self._rows(_STEPS, {"run": run, "after": after})
        return {"run": run, "steps": steps, "versions": self._rows(_VERSIONS, {"run": run})}

    # --- rollouts ---------------------------------------------------------------------------------------
    def rollouts(self, params: Mapping[str, str]) -> dict[str, Any]:
        filters = parse_filters(params)
        bound = {**vars(filters), **self._run_window(filters.run)}
        counts = {row["Status"]: row["N"] for row in self._rows(_ROLLOUT_COUNTS, bound)}
        return {
            "filters": vars(filters),
            "total": sum(counts.values()),
            "counts": counts,
            "rollouts": self._with_versions(self._rows(_ROLLOUTS, bound)),
        }

    def _with_versions(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Rollout rows with ``Version``: what served their calls, as their spans and transitions say
        (:func:`fulmen.versions.rollout_versions`), else the version they were dispatched under (``ModelVersion``)."""
        served = rollout_versions(self.reader, [(row["RolloutId"], row["Attempt"]) for row in rows])
        for row in rows:
            row["Version"] = served.get((row["RolloutId"], row["Attempt"])) or version_label(row["ModelVersion"])
        return rows

    def _run_window(self, run: str) -> dict[str, str]:
        """A run's rollouts: those last seen from its start (its first step's start) to the next run's start.

        Rollouts carry no run id; in local mode each run has its own store, so the window only matters when
        runs share one. An unknown run selects nothing.
        """
        if not run:
            return {"run_from": "1970-01-01 00:00:00", "run_to": "1970-01-01 00:00:00"}
        starts = sorted((r["StartedAt"], r["RunId"]) for r in self.runs())
        for index, (started, run_id) in enumerate(starts):
            if run_id == run:
                until = starts[index + 1][0] if index + 1 < len(starts) else "2999-01-01T00:00:00"
                return {"run_from": _sql_time(started), "run_to": _sql_time(until)}
        return {"run_from": "2999-01-01 00:00:00", "run_to": "2999-01-01 00:00:00"}

    def rollout(self, params: Mapping[str, str]) -> dict[str, Any]:
        """One rollout attempt: its lifecycle row(s), its spans as a tree, its transitions with their credit."""
        rollout_id = _identifier(params, "id", required=True)
        attempts = self._with_versions(self._rows(_ATTEMPTS, {"id": rollout_id}))
        attempt = _integer(params, "attempt", max((a["Attempt"] for a in attempts), default=1), 1, 100)
        credit = _choice(params, "credit", CREDIT_STRATEGIES.names()) or "broadcast"
        gamma = _gamma(params.get("gamma", ""))
        bound = {"id": rollout_id, "attempt": attempt}
        spans = trace_tree(self._rows(_SPANS, bound))
        transitions = self._rows(_TRANSITIONS, bound)
        if transitions:
            credited = assign_credit(
                credit, transitions[0]["EpisodeReward"], [t["IntermediateReward"] for t in transitions], gamma
            )
            for transition, value in zip(transitions, credited, strict=True):
                transition["Credited"] = value
        return {
            "id": rollout_id,
            "attempt": attempt,
            "attempts": attempts,
            "spans": spans,
            "transitions": transitions,
            "credit": {"strategy": credit, "gamma": gamma, "strategies": CREDIT_STRATEGIES.names()},
        }

    # --- model versions ---------------------------------------------------------------------------------
    def models(self, params: Mapping[str, str]) -> dict[str, Any]:
        """A model's versions (default: the first stored), their scores and promotion decisions, which serves."""
        names = model_names(self.reader)
        model = _identifier(params, "model") or (names[0] if names else "")
        rows = [vars(row) for row in version_rows(self.reader, model)] if model else []
        return {"models": names, "model": model, "versions": rows}

    # --- prompt bundles ---------------------------------------------------------------------------------
    def prompts(self, params: Mapping[str, str]) -> dict[str, Any]:
        """The stored bundles, newest first (or those of one search ``run``): agent scope, source, parents, each
        slot's text shortened, the mean of the validation scores their lineage stores (and per task), the ended
        rollouts that named each per mode with their mean reward, and the agent scopes each serves now
        (``serving``: scope -> bundle, '' = the agent's own prompts). Reads :mod:`fulmen.prompt_queries`."""
        run = _identifier(params, "run")
        stored = bundle_rows(self.reader)
        rows = [row for row in stored if not run or row.run_id == run]
        rewards = bundle_rewards(self.reader)
        serving = serving_by_scope(self.reader)
        bundles = [
            {
                "bundle_id": row.bundle_id,
                "agent": row.agent,
                "source": row.source,
                "run_id": row.run_id,
                "created_at": row.created_at,
                "parents": list(row.parents),
                "slots": {slot: _shortened(text) for slot, text in sorted(row.slots.items())},
                "templates": sorted(row.templates),
                "val_mean": row.mean,
                "val_tasks": len(row.scores),
                "scores": dict(sorted(row.scores.items())),
                "rollouts": {mode: vars(r) for mode, r in rewards.get(row.bundle_id, {}).items()},
                "serving": sorted(scope for scope, bundle in serving.items() if bundle == row.bundle_id),
            }
            for row in reversed(rows)
        ]
        return {"bundles": bundles, "serving": serving, "runs": sorted({row.run_id for row in stored if row.run_id})}

    # --- dead letters -----------------------------------------------------------------------------------
    def dead_letters(self, params: Mapping[str, str]) -> dict[str, Any]:
        limit = _integer(params, "limit", 100, 1, _MAX_PAGE)
        total = self._rows(_DEAD_LETTER_COUNT)[0]["N"]
        return {"total": total, "records": self._rows(_DEAD_LETTERS, {"limit": limit})}


def _shortened(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _SLOT_CHARS else flat[: _SLOT_CHARS - 1] + "…"


def _gamma(text: str) -> float:
    if not text:
        return 1.0
    try:
        gamma = float(text)
    except ValueError:
        gamma = math.nan
    if not 0.0 < gamma <= 1.0:
        raise FilterError(f"gamma must be a number in (0, 1], not {text[:40]!r}")
    return gamma


def _sql_time(iso: str) -> str:
    """An ISO timestamp from :func:`jsonable` as ClickHouse's toDateTime64 reads it."""
    return datetime.fromisoformat(iso).strftime("%Y-%m-%d %H:%M:%S.%f")


def _parsed(text: str | None) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:  # cut at _MESSAGE_CHARS, or not JSON: shown as text
        return text


def trace_tree(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The spans in tree order (each after its parent, siblings by start time), each with its ``Depth``, its
    start ``OffsetMs`` from the earliest span and ``DurationMs``; the messages of LLM calls parsed from JSON.
    A span whose parent is not among them is a root (its parent lives in another process's trace), and so is
    one caught in a cycle of parents (a malformed trace is shown, not dropped)."""
    if not spans:
        return []
    ids = {span["SpanId"] for span in spans}
    children: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        parent = span["ParentSpanId"] if span["ParentSpanId"] in ids else ""
        children.setdefault(parent, []).append(span)
    start = min(datetime.fromisoformat(span["Timestamp"]) for span in spans)
    ordered: list[dict[str, Any]] = []
    seen: set[int] = set()
    stack = [(span, 0) for span in reversed(children.get("", []))]
    for loose in reversed(spans):  # popped after the roots' trees: whatever they did not reach
        stack.insert(0, (loose, 0))
    while stack:
        span, depth = stack.pop()
        if id(span) in seen:
            continue
        seen.add(id(span))
        began = datetime.fromisoformat(span["Timestamp"])
        span.update(
            {
                "Depth": depth,
                "OffsetMs": (began - start).total_seconds() * 1000,
                "DurationMs": span["Duration"] / 1e6,
                "InputMessages": _parsed(span["InputMessages"]),
                "OutputMessages": _parsed(span["OutputMessages"]),
                "Attributes": dict(span["Attributes"] or []),
            }
        )
        ordered.append(span)
        stack.extend((child, depth + 1) for child in reversed(children.get(span["SpanId"], [])))
    return ordered
