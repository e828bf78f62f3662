"""What ``fulmen prompts scan`` and ``list`` (and the dashboard's Prompts page) read from the store: the prompts
agents send, the stored bundles, where each serves and what its rollouts scored.

``scan`` groups the input messages of the LLM gateway's chat spans (``gen_ai.input.messages``) by role and text,
skipping calls a bundle was applied to (their texts are the bundle's, not the agent's), with the agents that sent
each (the span's agent, else the one its URL named: ``/agent/{name}``), and names each prompt by its fingerprint
slot (:func:`fulmen.schemas.prompts.fingerprint`): the name to put in a bundle to replace it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fulmen.schemas import semconv
from fulmen.schemas.ddl import TABLES
from fulmen.schemas.events import RolloutStatus
from fulmen.schemas.prompts import PromptBundle, fingerprint, message_text

__all__ = [
    "BundleRewards",
    "BundleRow",
    "ScannedPrompt",
    "bundle_mismatches",
    "bundle_rewards",
    "bundle_rows",
    "scan_prompts",
    "serving_by_scope",
    "stored_bundle",
]

_SCAN_SQL = """
SELECT JSONExtractString(m, 'role') AS role, JSONExtractRaw(m, 'content') AS content, count() AS calls,
       groupUniqArray(8)(if(AgentName != '', AgentName, SpanAttributes[%(llm_agent)s])) AS agents
FROM {db}{spans}
ARRAY JOIN JSONExtractArrayRaw(SpanAttributes[%(messages)s]) AS m
WHERE SpanAttributes[%(messages)s] != '' AND SpanAttributes[%(bundle)s] = '' AND role IN %(roles)s{rollouts}
GROUP BY role, content
ORDER BY calls DESC
LIMIT %(limit)s
"""


@dataclass(frozen=True)
class ScannedPrompt:
    """A prompt agents send: its slot name, role, how many calls sent it, which agents, and its text."""

    slot: str
    role: str
    calls: int
    agents: tuple[str, ...]
    text: str


def scan_prompts(
    reader: Any,
    database: str = "",
    roles: tuple[str, ...] = ("system", "user"),
    limit: int = 1000,
    rollout_ids: tuple[str, ...] | None = None,
) -> list[ScannedPrompt]:
    """The prompts stored spans carry, most sent first, merged by fingerprint (texts that differ only in whitespace
    are one slot); ``rollout_ids``: only those rollouts' calls."""
    db = f"{database}." if database else ""
    only = " AND RolloutId IN %(rollouts)s" if rollout_ids is not None else ""
    sql = _SCAN_SQL.format(db=db, spans=TABLES["spans"], rollouts=only)
    parameters = {
        "messages": semconv.GEN_AI_INPUT_MESSAGES,
        "bundle": semconv.PROMPT_BUNDLE,
        "roles": tuple(roles),
        "limit": limit,
        "rollouts": tuple(rollout_ids or ("",)),
        "llm_agent": semconv.LLM_AGENT,
    }
    found: dict[str, dict[str, Any]] = {}
    for role, content, calls, agents in reader.query(sql, parameters, read_only=True).rows:
        text = message_text(json.loads(content)) if content else None
        if text is None:
            continue
        slot = fingerprint(role, text)
        entry = found.setdefault(slot, {"role": role, "calls": 0, "agents": set(), "text": text})
        entry["calls"] += int(calls)
        entry["agents"].update(a for a in agents if a)
    prompts = [
        ScannedPrompt(slot, e["role"], e["calls"], tuple(sorted(e["agents"])), e["text"]) for slot, e in found.items()
    ]
    return sorted(prompts, key=lambda p: (-p.calls, p.slot))


@dataclass(frozen=True)
class BundleRow:
    """A stored bundle as ``fulmen prompts list`` shows it."""

    bundle_id: str
    parents: tuple[str, ...]
    slots: dict[str, str]
    templates: dict[str, str]
    scores: dict[str, float]
    agent: str | None
    source: str
    run_id: str
    created_at: Any

    @property
    def mean(self) -> float | None:
        return sum(self.scores.values()) / len(self.scores) if self.scores else None


def bundle_rows(reader: Any, database: str = "", bundle_id: str | None = None) -> list[BundleRow]:
    """The stored bundles (or the one named), oldest first."""
    db = f"{database}." if database else ""
    where = "WHERE BundleId = %(id)s" if bundle_id else ""
    sql = (
        f"SELECT BundleId, Parents, Slots, Templates, Scores, Agent, Source, RunId, CreatedAt "
        f"FROM {db}{TABLES['prompt_bundles']} {where} ORDER BY CreatedAt"
    )
    rows = reader.query(sql, {"id": bundle_id} if bundle_id else None, final=True, read_only=True).rows
    return [BundleRow(r[0], tuple(r[1]), dict(r[2]), dict(r[3]), dict(r[4]), r[5], r[6], r[7], r[8]) for r in rows]


def stored_bundle(reader: Any, database: str, bundle_id: str) -> PromptBundle | None:
    """The stored bundle ``bundle_id`` as the event that published it (to publish it again elsewhere), or None."""
    rows = bundle_rows(reader, database, bundle_id)
    if not rows:
        return None
    row = rows[-1]
    return PromptBundle.create(
        row.slots,
        templates=row.templates,
        parents=row.parents,
        scores=row.scores,
        agent=row.agent,
        source=row.source,
        run_id=row.run_id,
    )


def serving_by_scope(reader: Any, database: str = "") -> dict[str, str]:
    """Per agent scope ('' for every agent), the bundle the latest stored promotion serves ('' for the agent's own
    prompts)."""
    db = f"{database}." if database else ""
    sql = f"SELECT Agent, argMax(BundleId, CreatedAt) FROM {db}{TABLES['prompt_promotions']} GROUP BY Agent"
    return {agent: bundle for agent, bundle in reader.query(sql, None, final=True, read_only=True).rows}


_REWARDS_SQL = """
SELECT PromptBundle, Mode, count() AS rollouts, countIf(Reward IS NOT NULL) AS rewarded, avg(Reward) AS mean
FROM {db}{rollouts} WHERE PromptBundle != '' AND Status IN %(ended)s
GROUP BY PromptBundle, Mode ORDER BY PromptBundle, Mode
"""


@dataclass(frozen=True)
class BundleRewards:
    """The ended rollouts (latest attempt state) that named a bundle, in one mode: how many, how many have a reward,
    and their mean reward (None: none has one)."""

    rollouts: int
    rewarded: int
    mean: float | None


def bundle_rewards(reader: Any, database: str = "") -> dict[str, dict[str, BundleRewards]]:
    """Per bundle, per rollout mode (``train``, ``val``, ...), the ended rollouts that named it and their mean reward:
    what the bundle scored wherever it ran (a search's minibatches, validation and test passes, a GRPO phase), beside
    the validation scores its lineage stores."""
    db = f"{database}." if database else ""
    sql = _REWARDS_SQL.format(db=db, rollouts=TABLES["rollouts"])
    ended = (RolloutStatus.SUCCEEDED.value, RolloutStatus.FAILED.value, RolloutStatus.TIMED_OUT.value)
    found: dict[str, dict[str, BundleRewards]] = {}
    for bundle, mode, rollouts, rewarded, mean in reader.query(sql, {"ended": ended}, final=True, read_only=True).rows:
        found.setdefault(bundle, {})[mode] = BundleRewards(int(rollouts), int(rewarded), mean if rewarded else None)
    return found


_MISMATCH_SQL = """
SELECT count() AS calls, countIf(s.SpanAttributes[%(bundle)s] != r.PromptBundle) AS mismatches
FROM {db}{spans} AS s
INNER JOIN (SELECT RolloutId, Attempt, max(PromptBundle) AS PromptBundle FROM {db}{rollouts}
            GROUP BY RolloutId, Attempt) AS r ON s.RolloutId = r.RolloutId AND s.Attempt = r.Attempt
WHERE s.SpanAttributes[%(op)s] IN %(ops)s{only}
"""


def bundle_mismatches(reader: Any, database: str = "", rollout_ids: tuple[str, ...] | None = None) -> tuple[int, int]:
    """``(LLM calls checked, calls whose span names a bundle other than its rollout's)`` over the stored calls of
    dispatched rollouts (or of ``rollout_ids``). A rollout that named no bundle has '' and so must its calls: a call
    served with a promoted bundle inside such a rollout counts as a mismatch too."""
    db = f"{database}." if database else ""
    only = " AND s.RolloutId IN %(ids)s" if rollout_ids is not None else ""
    sql = _MISMATCH_SQL.format(db=db, spans=TABLES["spans"], rollouts=TABLES["rollouts"], only=only)
    parameters = {
        "bundle": semconv.PROMPT_BUNDLE,
        "op": semconv.GEN_AI_OPERATION_NAME,
        "ops": (semconv.OPERATION_CHAT, semconv.OPERATION_TEXT_COMPLETION),
        "ids": tuple(rollout_ids or ("",)),
    }
    [[calls, mismatches]] = reader.query(sql, parameters, final=True, read_only=True).rows
    return int(calls), int(mismatches)
