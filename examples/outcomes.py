"""Each validated task's outcome per model version, with its template and failure kind, read from the run's store.

What a skeptic asks after a run: which problems got better, of which shape, and what went wrong on the others.
:func:`validation_episodes` asks the store with SQL, as a user would (``fulmen sql``): each validation episode's
task, version, status and reward (``rollouts``), and what the model wrote at each of its LLM calls (the gateway's
spans, ``gen_ai.output.messages``, in call order). :func:`outcomes_by_split` files them by split (held-out,
unseen shapes) and version: per task, solved or not and the failure kind, which the example's
``failure_kind(task, episode)`` names (a generic one for examples without: ``correct``, ``wrong``,
``timed_out``, ``failed``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fulmen.schemas.events import RolloutMode

if TYPE_CHECKING:
    from examples.train import Splits

__all__ = ["SOLVED", "Episode", "argument_of_calls", "generic_failure_kind", "outcomes_by_split", "validation_episodes"]

SOLVED = 0.999  # an episode with at least this reward counts as solved


@dataclass(frozen=True)
class Episode:
    """One validation episode as the store holds it: its status, reward, and each call's output message."""

    task_id: str
    version: str
    status: str
    reward: float
    outputs: list[dict[str, Any]] = field(default_factory=list)  # the assistant message of each call, in order

    @property
    def solved(self) -> bool:
        return self.status == "succeeded" and self.reward >= SOLVED


def generic_failure_kind(task: dict[str, Any], episode: Episode) -> str:
    """``correct``, ``timed_out``, ``failed`` (the agent raised) or ``wrong``."""
    if episode.solved:
        return "correct"
    return episode.status if episode.status in ("timed_out", "failed") else "wrong"


def argument_of_calls(message: dict[str, Any], key: str) -> list[str]:
    """Argument ``key`` of each tool call in one assistant message, as the model wrote it ("" where a call's arguments
    are not a JSON object holding a string ``key``)."""
    found = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            parsed = None
        value = parsed.get(key) if isinstance(parsed, dict) else None
        found.append(value if isinstance(value, str) else "")
    return found


def validation_episodes(
    run: Any, db: str, sql: Callable[[Any, str], list[dict[str, Any]]] | None = None
) -> list[Episode]:
    """The latest attempt of every validation episode of the run, with the output of each of its LLM calls."""
    if sql is None:
        from examples.train import sql
    val = RolloutMode.VAL.value
    rows = sql(
        run,
        f"SELECT RolloutId AS rollout, toString(ModelVersion) AS version, TaskId AS task, "
        f"argMax(Status, Attempt) AS status, argMax(ifNull(Reward, 0.), Attempt) AS reward, "
        f"max(Attempt) AS attempt FROM {db}.rollouts FINAL WHERE Mode = '{val}' "
        f"AND Status IN ('succeeded', 'failed', 'timed_out') GROUP BY rollout, version, task",
    )
    calls = sql(
        run,
        f"SELECT RolloutId AS rollout, Attempt AS attempt, arrayMap(x -> x.2, arraySort(x -> x.1, "
        f"groupArray((Timestamp, SpanAttributes['gen_ai.output.messages'])))) AS outputs "
        f"FROM {db}.otel_traces WHERE ServiceName = 'fulmen-llm-gateway' AND RolloutId IN (SELECT "
        f"RolloutId FROM {db}.rollouts WHERE Mode = '{val}') GROUP BY rollout, attempt",
    )
    written = {(c["rollout"], int(c["attempt"])): _messages(c["outputs"]) for c in calls}
    return [
        Episode(
            r["task"], r["version"], r["status"], float(r["reward"]), written.get((r["rollout"], int(r["attempt"])), [])
        )
        for r in rows
    ]


def _messages(outputs: list[str]) -> list[dict[str, Any]]:
    """The calls' assistant messages, in call order (each span's ``gen_ai.output.messages`` holds one)."""
    messages = []
    for text in outputs:
        try:
            decoded = json.loads(text) if text else []
        except ValueError:
            decoded = []
        first = decoded[0] if isinstance(decoded, list) and decoded else None
        messages.append(first if isinstance(first, dict) else {})
    return messages


def outcomes_by_split(example: Any, splits: Splits, episodes: list[Episode]) -> dict[str, Any]:
    """``{"outcomes": {split: {"tasks": [ids], "templates": [...], "by_version": {version: {"solved": [bools],
    "failures": [kinds], "rewards": [episode rewards]}}}}}``, tasks in the split's order; a task with no episode
    at a version counts as ``missing`` (not solved, reward 0)."""
    kind_of = getattr(example, "failure_kind", None) or generic_failure_kind
    by_task_version = {(e.task_id, e.version): e for e in episodes}
    versions = sorted({e.version for e in episodes}, key=lambda v: int(v) if v.isdigit() else -1)
    outcomes: dict[str, Any] = {}
    for name, tasks in (("heldout", splits.heldout), ("unseen", splits.unseen)):
        if not tasks:
            continue
        by_version = {}
        for version in versions:
            found = [by_task_version.get((t.task_id, version)) for t in tasks]
            by_version[version] = {
                "solved": [bool(e and e.solved) for e in found],
                "failures": [kind_of(t.input, e) if e else "missing" for t, e in zip(tasks, found, strict=True)],
                "rewards": [round(e.reward, 4) if e else 0.0 for e in found],
            }
        outcomes[name] = {
            "tasks": [t.task_id for t in tasks],
            "templates": [str(t.input.get("template", "")) for t in tasks],
            "by_version": by_version,
        }
    return {"outcomes": outcomes}
