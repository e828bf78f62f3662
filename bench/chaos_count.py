"""The chaos bench's counts: what was sent against what the store (and Kafka) hold, per unit and per phase.

Every unit of work is attributed to the phase (the component killed in that window) in which it was sent;
:data:`DEFINITIONS` says what "sent", "stored", "lost" and "doubled" mean for each kind of unit, and is
printed with the report. Store queries go through the read endpoint of ``fulmen consume`` (or the store once
it has exited), with ``final`` on (the dedup ``fulmen sql`` applies by default, README) unless said otherwise.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.chaos_load import LOAD_SERVICE
from fulmen.schemas import semconv
from fulmen.schemas.events import TERMINAL_STATUSES, RolloutStatus

__all__ = ["DEFINITIONS", "Counts", "Phases", "count_all"]

DEFINITIONS = {
    "phase": "units are attributed to the window of the component killed in it (from that phase's start to the "
    "next one's); units of the warm-up and the drain count only in totals",
    "query": "store counts use the dedup `fulmen sql` applies by default (SELECT with setting final=1, i.e. "
    "FINAL on every ReplacingMergeTree); raw_copies counts the extra rows a query WITHOUT final sees",
    "spans": "sent = spans of the bench's OTLP client (service.name chaos-load) whose POST got a 200 (a failed "
    "POST is retried unchanged until 200 and counted once); stored = distinct SpanId of those in "
    "otel_traces; lost = sent - stored; doubled = sent spans with more than one row under FINAL",
    "llm_calls": "sent = chat completions answered 200 (the bench's direct calls and the chaos agent's calls, by "
    "response id); stored = those with a span (gen_ai.response.id) in otel_traces; lost = sent - "
    "stored; doubled = response ids with more than one span row under FINAL (two span ids or copies)",
    "rollouts": "sent = rollout ids requested on the tasks topic (attempt 1: `fulmen submit` and the trainer's "
    "dispatcher); stored = those whose latest attempt in `rollouts` (FINAL) is terminal and is at "
    "least the highest attempt requested; lost = sent - stored; doubled = (rollout, attempt) pairs "
    "with more than one row under FINAL",
    "transitions": "sent = rollouts whose latest attempt succeeded; stored = those whose transitions rows for "
    "that attempt cover every LLM span of that attempt (one row per call); lost = sent - stored; "
    "doubled = (rollout, attempt, span) with more than one transitions row under FINAL",
    "feedback": "sent = feedback posted to the LLM gateway's /v1/feedback answered 202 (each scores a direct call or "
    "an agent's call answered 200, or a rollout seen on the rollouts topic: targets that exist), by "
    "feedback id; stored = distinct FeedbackId of those in `feedback` (FINAL); lost = sent - stored; "
    "doubled = feedback ids with more than one row under FINAL (every target here is one call or one "
    "episode: one row); details: dead_lettered = sent feedback on the dead-letter topic (must be 0: "
    "the target exists), stored_without_a_202 = stored feedback no client got a 202 for",
    "model_versions": "sent = versions the trainer checkpointed (checkpoints/v<N>) or published; stored = "
    "versions on the models topic; lost = checkpointed versions never published plus gaps in "
    "1..max published; doubled = versions published more than once on the models topic "
    "(raw records: no dedup there) plus steps with more than one TrainStep on the metrics topic",
    "recovery_s": "from the restart (process spawned) to the first new unit acknowledged or stored: otlp_gateway "
    "and broker: a span POST answered 200; llm_gateway: a call answered 200; consume: a span row "
    "with IngestedAt after the restart; runner: a terminal rollout event; trainer: a model version "
    "published",
}


class Phases:
    """Named windows: phase i runs from ``starts[i]`` to ``starts[i + 1]`` (the last one to the end)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.starts: list[float] = []

    def begin(self, name: str, at: float) -> None:
        self.names.append(name)
        self.starts.append(at)

    def of(self, moment: float) -> str:
        index = bisect.bisect_right(self.starts, moment) - 1
        return self.names[index] if index >= 0 else "warmup"


@dataclass
class Counts:
    """sent/stored/lost/doubled (and raw copies) of one kind of unit, per phase name."""

    sent: Counter
    stored: Counter
    doubled: Counter
    raw_copies: Counter

    @classmethod
    def empty(cls) -> Counts:
        return cls(Counter(), Counter(), Counter(), Counter())

    def row(self, phase: str | None = None) -> dict[str, int]:
        def pick(counter: Counter) -> int:
            return sum(counter.values()) if phase is None else counter.get(phase, 0)

        sent, stored = pick(self.sent), pick(self.stored)
        return {
            "sent": sent,
            "stored": stored,
            "lost": sent - stored,
            "doubled": pick(self.doubled),
            "raw_copies": pick(self.raw_copies),
        }


def _rows(reader: Any, sql: str, final: bool = True) -> list[list[Any]]:
    return reader.query(sql, final=final).rows


def count_ids(sent: dict[str, str], final: dict[str, int], raw: dict[str, int]) -> Counts:
    """``sent``: id -> phase; ``final``/``raw``: id -> rows with and without FINAL."""
    counts = Counts.empty()
    for unit, phase in sent.items():
        counts.sent[phase] += 1
        if final.get(unit, 0) >= 1:
            counts.stored[phase] += 1
        if final.get(unit, 0) > 1:
            counts.doubled[phase] += 1
        counts.raw_copies[phase] += max(0, raw.get(unit, 0) - 1)
    return counts


def span_counts(reader: Any, db: str, sent: dict[str, str]) -> Counts:
    sql = f"SELECT SpanId, count() FROM {db}.otel_traces WHERE ServiceName = '{LOAD_SERVICE}' GROUP BY SpanId"
    return count_ids(sent, dict(_rows(reader, sql)), dict(_rows(reader, sql, final=False)))


def llm_counts(reader: Any, db: str, sent: dict[str, str]) -> tuple[Counts, dict[str, Any]]:
    """Counts, and the LLM spans stored for calls no client got a 200 for (by rollout or direct)."""
    key = f"SpanAttributes['{semconv.GEN_AI_RESPONSE_ID}']"
    sql = f"SELECT {key} AS id, any(RolloutId), count() FROM {db}.otel_traces WHERE {key} != '' GROUP BY id"
    final = {unit: (rollout, n) for unit, rollout, n in _rows(reader, sql)}
    raw = {unit: n for unit, _, n in _rows(reader, sql, final=False)}
    counts = count_ids(sent, {unit: n for unit, (_, n) in final.items()}, raw)
    orphans = [(unit, rollout) for unit, (rollout, _) in final.items() if unit not in sent]
    detail = {
        "spans_without_a_200": len(orphans),
        "of_them_in_rollouts": sum(1 for _, r in orphans if r),
        "sample": orphans[:5],
    }
    return counts, detail


def feedback_counts(reader: Any, db: str, sent: dict[str, str], topic: str) -> tuple[Counts, dict[str, Any]]:
    """Counts, and the sent feedback that was dead-lettered (with why) or stored without a 202."""
    sql = f"SELECT FeedbackId, count() FROM {db}.feedback GROUP BY FeedbackId"
    final = dict(_rows(reader, sql))
    counts = count_ids(sent, final, dict(_rows(reader, sql, final=False)))
    dead = _rows(
        reader,
        f"SELECT JSONExtractString(ValuePreview, 'feedback_id') AS id, any(Error) "
        f"FROM {db}.dead_letters WHERE SourceTopic = '{topic}' GROUP BY id",
    )
    known = [(unit, error[:300]) for unit, error in dead if unit in sent]
    detail = {
        "dead_lettered": len(known),
        "dead_lettered_sample": known[:5],
        "dead_lettered_unsent": len(dead) - len(known),
        "stored_without_a_202": sum(1 for unit in final if unit not in sent),
    }
    return counts, detail


def agent_calls(path: Path, phases: Phases) -> dict[str, str]:
    """The chaos agent's 200s (its JSONL file): response id -> phase."""
    calls = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                item = json.loads(line)
            except ValueError:
                continue  # a line cut by the runner's SIGKILL
            calls[item["id"]] = phases.of(item["t"])
    return calls


@dataclass
class RolloutFacts:
    requested: dict[str, str]  # rollout id -> phase of its first request
    max_requested: dict[str, int]  # rollout id -> highest attempt requested on the tasks topic
    rows: list[list[Any]]  # (RolloutId, Attempt, Status) under FINAL
    raw: list[list[Any]]  # (RolloutId, Attempt, rows) without FINAL


def rollout_facts(reader: Any, db: str, tasks: Iterable[tuple[float, Any]], phases: Phases) -> RolloutFacts:
    requested: dict[str, str] = {}
    max_requested: dict[str, int] = defaultdict(int)
    for at, request in sorted(tasks, key=lambda item: item[0]):
        if request.attempt == 1:
            requested.setdefault(request.rollout_id, phases.of(at))
        max_requested[request.rollout_id] = max(max_requested[request.rollout_id], request.attempt)
    rows = _rows(reader, f"SELECT RolloutId, Attempt, Status FROM {db}.rollouts")
    raw = _rows(
        reader, f"SELECT RolloutId, Attempt, count() FROM {db}.rollouts GROUP BY RolloutId, Attempt", final=False
    )
    return RolloutFacts(requested, dict(max_requested), rows, raw)


def rollout_counts(facts: RolloutFacts) -> tuple[Counts, dict[str, tuple[int, str]], dict[str, Any]]:
    """Counts, the latest (attempt, status) per rollout, and details (statuses, samples of what is missing)."""
    per_attempt = Counter((rid, attempt) for rid, attempt, _ in facts.rows)
    latest: dict[str, tuple[int, str]] = {}
    succeeded_attempts: Counter = Counter()
    for rid, attempt, status in facts.rows:
        if rid not in latest or attempt > latest[rid][0]:
            latest[rid] = (attempt, status)
        succeeded_attempts[rid] += status == RolloutStatus.SUCCEEDED.value
    raw = {(rid, attempt): n for rid, attempt, n in facts.raw}
    terminal = {s.value for s in TERMINAL_STATUSES}
    counts, missing = Counts.empty(), []
    for rid, phase in facts.requested.items():
        counts.sent[phase] += 1
        attempt, status = latest.get(rid, (0, "none"))
        if status in terminal and attempt >= facts.max_requested.get(rid, 1):
            counts.stored[phase] += 1
        else:
            missing.append(f"{rid}: latest {status} attempt {attempt}, requested {facts.max_requested.get(rid)}")
        counts.doubled[phase] += sum(1 for (r, _), n in per_attempt.items() if r == rid and n > 1)
        counts.raw_copies[phase] += sum(max(0, n - 1) for (r, _), n in raw.items() if r == rid)
    statuses = Counter(latest[rid][1] for rid in facts.requested if rid in latest)
    detail = {
        "latest_status": dict(statuses),
        "missing_sample": missing[:10],
        "succeeded_more_than_once": sum(1 for rid in facts.requested if succeeded_attempts[rid] > 1),
    }
    return counts, latest, detail


def transition_counts(
    reader: Any, db: str, facts: RolloutFacts, latest: dict[str, tuple[int, str]], batches: Iterable[tuple[float, Any]]
) -> tuple[Counts, dict[str, Any]]:
    key = f"SpanAttributes['{semconv.GEN_AI_RESPONSE_ID}']"
    calls: dict[tuple[str, int], set[str]] = defaultdict(set)
    for rid, attempt, span in _rows(
        reader, f"SELECT RolloutId, Attempt, SpanId FROM {db}.otel_traces WHERE {key} != '' AND RolloutId != ''"
    ):
        calls[(rid, attempt)].add(span)
    rows: dict[tuple[str, int], Counter] = defaultdict(Counter)
    for rid, attempt, span, n in _rows(
        reader, f"SELECT RolloutId, Attempt, SpanId, count() FROM {db}.transitions GROUP BY RolloutId, Attempt, SpanId"
    ):
        rows[(rid, attempt)][span] += n
    raw = {
        (rid, attempt, span): n
        for rid, attempt, span, n in _rows(
            reader,
            f"SELECT RolloutId, Attempt, SpanId, count() FROM {db}.transitions GROUP BY RolloutId, Attempt, SpanId",
            final=False,
        )
    }
    counts, missing, superseded = Counts.empty(), [], 0
    for rid, phase in facts.requested.items():
        attempt, status = latest.get(rid, (0, "none"))
        superseded += any(r == rid and a != attempt for r, a in rows)
        if status != RolloutStatus.SUCCEEDED.value:
            continue
        counts.sent[phase] += 1
        expected, got = calls.get((rid, attempt), set()), rows.get((rid, attempt), Counter())
        if expected and expected <= set(got):
            counts.stored[phase] += 1
        else:
            missing.append(f"{rid} attempt {attempt}: {len(got)} rows for {len(expected)} LLM spans")
        counts.doubled[phase] += sum(1 for n in got.values() if n > 1)
        counts.raw_copies[phase] += sum(max(0, n - 1) for (r, a, _), n in raw.items() if (r, a) == (rid, attempt))
    copies = Counter((b.rollout_id, b.attempt) for _, b in batches)
    detail = {
        "missing_sample": missing[:10],
        "rollouts_with_superseded_attempt_rows": superseded,
        "batches_on_topic_more_than_once": sum(1 for n in copies.values() if n > 1),
    }
    return counts, detail


def version_counts(
    reader: Any, db: str, run_dir: Path, models: list[tuple[float, Any]], steps: list[tuple[float, Any]]
) -> tuple[dict[str, int], dict[str, Any]]:
    published = Counter(event.version for _, event in models)
    checkpointed = {int(p.name[1:]) for p in (run_dir / "checkpoints").glob("v*") if p.name[1:].isdigit()}
    top = max(published, default=0)
    sent = checkpointed | set(published)
    lost = (checkpointed - set(published)) | (set(range(1, top + 1)) - set(published))
    step_copies = Counter(event.step for _, event in steps)
    in_store = sum(
        1 for _, n in _rows(reader, f"SELECT Version, count() FROM {db}.model_versions GROUP BY Version") if n > 1
    )
    doubled = sum(1 for n in published.values() if n > 1) + sum(1 for n in step_copies.values() if n > 1)
    row = {
        "sent": len(sent),
        "stored": len(set(published)),
        "lost": len(lost),
        "doubled": doubled,
        "raw_copies": sum(n - 1 for n in published.values()),
    }
    detail = {
        "published": sorted(published.elements()),
        "checkpointed": sorted(checkpointed),
        "lost_versions": sorted(lost),
        "doubled_in_store_final": in_store,
        "train_steps_on_topic": sorted(step_copies.elements()),
        "uris": sorted({event.uri for _, event in models}),
        "served": sorted(  # the versions the LLM gateway answered calls with (its spans' ModelVersion)
            v for (v,) in _rows(reader, f"SELECT DISTINCT ModelVersion FROM {db}.otel_traces WHERE ModelVersion >= 0")
        ),
    }
    return row, detail


@dataclass
class AllCounts:
    kinds: dict[str, Counts]
    versions: dict[str, int]
    details: dict[str, Any]


def count_all(
    reader: Any,
    db: str,
    *,
    spans: dict[str, str],
    calls: dict[str, str],
    feedback: dict[str, str],
    feedback_topic: str,
    phases: Phases,
    topics: dict[str, list[tuple[float, Any]]],
    run_dir: Path,
) -> AllCounts:
    """Every count; ``topics`` holds the tasks, transitions, models and metrics topics read whole."""
    facts = rollout_facts(reader, db, topics["tasks"], phases)
    rollouts, latest, rollout_detail = rollout_counts(facts)
    transitions, transition_detail = transition_counts(reader, db, facts, latest, topics["transitions"])
    versions, version_detail = version_counts(reader, db, run_dir, topics["models"], topics["metrics"])
    llm, llm_detail = llm_counts(reader, db, calls)
    scored, feedback_detail = feedback_counts(reader, db, feedback, feedback_topic)
    kinds = {
        "spans": span_counts(reader, db, spans),
        "llm_calls": llm,
        "rollouts": rollouts,
        "transitions": transitions,
        "feedback": scored,
    }
    details = {
        "llm_calls": llm_detail,
        "rollouts": rollout_detail,
        "transitions": transition_detail,
        "model_versions": version_detail,
        "feedback": feedback_detail,
    }
    return AllCounts(kinds, versions, details)
