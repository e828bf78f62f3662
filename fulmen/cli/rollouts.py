"""``fulmen rollouts``: rollout status from the store, in a table that fits the terminal; one rollout's attempts."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any

import typer

from fulmen.cli.base import UtcOption, WideOption, console, friendly, load_settings, read_query
from fulmen.infra.settings import CliProcessSettings
from fulmen.schemas.errors import FulmenError
from fulmen.versions import rollout_versions, version_label

if TYPE_CHECKING:
    from fulmen.cli.render import TableStyle

__all__ = ["rollouts_command"]

_ID = re.compile(r"[A-Za-z0-9._:\-]+")


@friendly
def rollouts_command(
    rollout: Annotated[
        str | None, typer.Argument(help="a rollout id, or the start of one (as the list shows it): its attempts")
    ] = None,
    limit: Annotated[int, typer.Option(help="how many recent rollouts to list", min=1)] = 20,
    group: Annotated[str | None, typer.Option(help="only this group")] = None,
    wide: WideOption = False,
    utc: UtcOption = False,
) -> None:
    """Rollout status from the store: counts by status, then the most recent rollouts, ids shortened to unique
    prefixes (--wide: whole). Given a rollout id or its start: each attempt of that rollout, every value whole.
    Version is the model version that served the rollout's LLM calls (as its spans and transitions say; "0–1" when
    a new version was published mid-rollout), else the one it was dispatched under, else "–"."""
    from fulmen.cli.render import render, table_style
    from fulmen.infra.store import QueryResult, open_reader

    settings = load_settings(CliProcessSettings)
    style = table_style(settings.cli, wide=wide, utc=utc)
    reader, db = open_reader(settings), settings.clickhouse.database
    for name, value in (("rollout", rollout), ("--group", group)):
        if value is not None and not _ID.fullmatch(value):
            raise FulmenError(f"{name} must be an id (letters, digits, . _ : -)")
    if rollout is not None:
        _show_attempts(reader, db, _resolve(reader, db, rollout), style)
        return
    where, bound = ("WHERE GroupId = %(group)s", {"group": group}) if group else ("", {})
    # Aliases differ from the columns: ClickHouse would read Attempt in argMax(Status, Attempt) as max(Attempt).
    latest = (
        f"SELECT RolloutId, max(Attempt) AS LastAttempt, argMax(Status, Attempt) AS State, "
        f"argMax(Reward, Attempt) AS LastReward, argMax(ModelVersion, Attempt) AS Dispatched, any(GroupId) AS "
        f"AnyGroup, max(Timestamp) AS Updated FROM {db}.rollouts {where} GROUP BY RolloutId"
    )
    counts = f"SELECT State AS Status, count() AS Rollouts FROM ({latest}) GROUP BY State ORDER BY State"
    render(read_query(reader, counts, bound), "table", console, style)
    page = read_query(reader, f"SELECT * FROM ({latest}) ORDER BY Updated DESC, RolloutId LIMIT {int(limit)}", bound)
    rows = [dict(zip(page.columns, row, strict=True)) for row in page.rows]
    rows = _with_served(reader, db, [r | {"Attempt": r["LastAttempt"]} for r in rows])
    result = QueryResult(
        ["RolloutId", "Attempt", "Status", "Reward", "Version", "GroupId", "Updated"],
        [
            [r["RolloutId"], r["Attempt"], r["State"], r["LastReward"], _version(r), r["AnyGroup"], r["Updated"]]
            for r in rows
        ],
    )
    render(result, "table", console, style)


def _resolve(reader: Any, db: str, prefix: str) -> str:
    """The one rollout id that starts with ``prefix`` (an exact id wins)."""
    found = read_query(
        reader,
        f"SELECT DISTINCT RolloutId FROM {db}.rollouts WHERE startsWith(RolloutId, %(p)s) ORDER BY RolloutId LIMIT 6",
        {"p": prefix},
    ).rows
    ids = [str(row[0]) for row in found]
    if prefix in ids:
        return prefix
    if not ids:
        raise FulmenError(f"no rollout id starts with {prefix!r}")
    if len(ids) > 1:
        shown = ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else "")
        raise FulmenError(f"{prefix!r} starts more than one rollout id ({shown}): give more of it")
    return ids[0]


def _show_attempts(reader: Any, db: str, rollout_id: str, style: TableStyle) -> None:
    """One column per attempt, one row per field, every value whole (the ids too): it fits any terminal."""
    from fulmen.cli.render import render
    from fulmen.infra.store import QueryResult

    rows = read_query(
        reader,
        f"SELECT Attempt, Status, Mode, Reward, ModelVersion AS Dispatched, TaskId, GroupId, "
        f"RunnerId, Error, Timestamp FROM {db}.rollouts WHERE RolloutId = %(id)s "
        "ORDER BY Attempt",
        {"id": rollout_id},
    )
    attempts = _with_served(
        reader, db, [dict(zip(rows.columns, row, strict=True)) | {"RolloutId": rollout_id} for row in rows.rows]
    )
    first = attempts[0]
    console.print(f"rollout {rollout_id}  task {first['TaskId']}  group {first['GroupId'] or '-'}", highlight=False)
    fields = [
        ("status", lambda a: a["Status"]),
        ("mode", lambda a: a["Mode"]),
        ("reward", lambda a: a["Reward"]),
        ("version", _version),
        ("dispatched", lambda a: version_label(a["Dispatched"])),
        ("runner", lambda a: a["RunnerId"] or "-"),
        ("updated", lambda a: a["Timestamp"]),
        ("error", lambda a: a["Error"] or "-"),
    ]
    result = QueryResult(
        ["", *(f"attempt {a['Attempt']}" for a in attempts)],
        [[name, *(get(a) for a in attempts)] for name, get in fields],
    )
    render(result, "table", console, style, count=False)


def _with_served(reader: Any, db: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` (rollout attempts) with the versions that served their calls, read once for all of them."""

    served = rollout_versions(reader, [(r["RolloutId"], int(r["Attempt"])) for r in rows], db)
    return [r | {"Served": served.get((r["RolloutId"], int(r["Attempt"])))} for r in rows]


def _version(row: dict[str, Any]) -> str:
    return row["Served"] or version_label(row["Dispatched"])
