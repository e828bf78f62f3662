"""What the store says of a model's versions: their runs, parents, held-out scores, promotion decisions, which
one serves, and which served a rollout. ``fulmen models list`` prints it and the dashboard's models page shows it;
``fulmen rollouts`` and the dashboard's rollout pages show a rollout's version with :func:`rollout_versions`; all
read through the read-only reader (values as bound parameters)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fulmen.schemas.events import PromotionAction

__all__ = ["VersionRow", "model_names", "paired_test_label", "rollout_versions", "version_label", "version_rows"]


def model_names(reader: Any, database: str = "") -> list[str]:
    """The models the store has versions of."""
    db = f"{database}." if database else ""
    rows = reader.query(
        f"SELECT DISTINCT ModelName FROM {db}model_versions ORDER BY ModelName", None, final=True, read_only=True
    ).rows
    return [str(row[0]) for row in rows]


@dataclass(frozen=True)
class VersionRow:
    """One version of a model as ``fulmen models list`` shows it."""

    version: int
    run_id: str
    parent: str
    score: float | None
    decision: str
    serving: bool
    uri: str
    test: str = "-"  # the gate's paired test: "+4.5 [+1.0, +8.0] n=200 (95%)", "-" when decided by hand


def version_rows(reader: Any, model_name: str, database: str = "") -> list[VersionRow]:
    """Every stored version of ``model_name`` (and every candidate a gated run judged), oldest first; ``database``:
    the tables' database when the reader's default is another."""
    db = f"{database}." if database else ""
    versions = reader.query(
        f"SELECT Version, RunId, Uri, BaseModel, CreatedAt FROM {db}model_versions "
        "WHERE ModelName = %(name)s AND Adapter = '' ORDER BY CreatedAt",
        {"name": model_name},
        final=True,
        read_only=True,
    ).rows
    scores = {
        (run, int(step)): score
        for run, step, score in reader.query(
            f"SELECT RunId, Step, Extra['val_accuracy'] FROM {db}train_steps WHERE mapContains(Extra, 'val_accuracy')",
            None,
            final=True,
            read_only=True,
        ).rows
    }
    decisions = reader.query(
        f"SELECT Version, RunId, Action, Score, Uri, BaseModel, CreatedAt, HeldoutN, Gain, GainLow, GainHigh, "
        f"Confidence FROM {db}promotions"
        " WHERE ModelName = %(name)s AND Adapter = '' ORDER BY CreatedAt",
        {"name": model_name},
        final=True,
        read_only=True,
    ).rows
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for version, run, uri, base, _ in versions:
        rows[(run, int(version))] = {"uri": uri, "base": base, "decision": "-", "score": None, "test": "-"}
    serving: tuple[str, int] | None = None
    for version, run, action, score, uri, base, _, *test in decisions:
        row = rows.setdefault((run, int(version)), {"uri": uri, "base": base, "decision": "-", "score": None})
        row["decision"] = {"promote": "promoted", "rollback": "rolled back to", "reject": "rejected"}[action]
        row["score"] = score if score is not None else row["score"]
        label = paired_test_label(*test)
        row["test"] = label if label != "-" else row.get("test", "-")  # a rollback keeps the test it was promoted by
        if action != PromotionAction.REJECT:
            serving = (run, int(version))
    shown = []
    for (run, version), row in rows.items():
        score = row["score"] if row["score"] is not None else scores.get((run, version))
        parent = f"v{version - 1}" if version > 1 else (row["base"] or "-")
        shown.append(
            VersionRow(
                version,
                run,
                parent if version > 0 else "-",
                score,
                row["decision"],
                serving == (run, version),
                row["uri"],
                row.get("test", "-"),
            )
        )
    return shown


def rollout_versions(reader: Any, keys: list[tuple[str, int]], database: str = "") -> dict[tuple[str, int], str]:
    """The version each rollout attempt in ``keys`` was served by, as :func:`version_label` shows it.

    A rollout's row carries the version its request was dispatched under (often none: ``fulmen submit`` names
    none), while each LLM call's span carries the version the gateway served it with, which its transition
    copies. What a rollout shows is what served its calls, read from its LLM spans, so that it matches them;
    an attempt whose calls two versions served (a new one published mid-rollout) shows both ends, "0–1".
    """
    if not keys:
        return {}
    db = f"{database}." if database else ""
    rows = reader.query(
        f"SELECT RolloutId, Attempt, min(ModelVersion), max(ModelVersion) FROM {db}otel_traces "
        "WHERE RolloutId IN %(ids)s AND ModelVersion IS NOT NULL GROUP BY RolloutId, Attempt",
        {"ids": sorted({rollout_id for rollout_id, _ in keys})},
        final=True,
        read_only=True,
    ).rows
    return {(str(rollout), int(attempt)): version_label(low, high) for rollout, attempt, low, high in rows}


def version_label(low: int | None, high: int | None = None) -> str:
    """How a version shows: "0"; "0–1" for calls served by versions 0 to 1; "–" when nothing says."""
    if low is None:
        return "–"
    return str(low) if high is None or high == low else f"{low}–{high}"


def paired_test_label(
    n: int | None, gain: float | None, low: float | None, high: float | None, confidence: float | None
) -> str:
    """A gated decision's paired test as ``fulmen models list`` and the dashboard show it; "-" when there was none
    (a decision by hand, or one stored before the gate tested pairs)."""
    if n is None or gain is None or low is None or high is None:
        return "-"
    level = f" ({100 * confidence:g}%)" if confidence else ""
    return f"{100 * gain:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}] n={n}{level}"
