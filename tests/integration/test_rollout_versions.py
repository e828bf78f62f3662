"""A rollout's version as `fulmen rollouts` and the dashboard show it, over a real store: the version that served
its LLM calls, the one its spans and its transitions carry (both ends when a new version served part of it),
not the row's own dispatched version, which `fulmen submit` leaves empty."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from fulmen.cli import base
from fulmen.cli.main import app
from fulmen.consumers.event_sinks import ROLLOUT_SCHEMA, TRANSITION_SCHEMA, rollout_rows, transition_rows
from fulmen.dashboard import DashboardQueries
from fulmen.infra.store import Store
from fulmen.schemas.ddl import TABLES
from fulmen.schemas.events import RolloutEvent, RolloutStatus, Transition, TransitionBatch
from fulmen.versions import rollout_versions

pytestmark = pytest.mark.integration

ONE, TWO, NONE = "a1" * 16, "b2" * 16, "c3" * 16  # served by 0; by 0 then 1; no call yet, dispatched under 4


def _fill(store: Store) -> None:
    events = [
        RolloutEvent(rollout_id=rollout, attempt=1, status=status, task_id="t", group_id="g", model_version=v)
        for rollout, status, v in (
            (ONE, RolloutStatus.SUCCEEDED, None),
            (TWO, RolloutStatus.SUCCEEDED, None),
            (NONE, RolloutStatus.RUNNING, 4),
        )
    ]
    rows = [row for event in events for row in rollout_rows(event)]
    store.insert_batch(TABLES["rollouts"], pa.Table.from_pylist(rows, ROLLOUT_SCHEMA))
    calls = [(ONE, 0, 0), (TWO, 0, 0), (TWO, 1, 1)]  # (rollout, call index, version that served it)
    values = ", ".join(
        f"(now64(9), '{'0' * 32}', '{rollout[:8]}{index:08d}', '{rollout}', 1, {version})"
        for rollout, index, version in calls
    )
    store.command(
        f"INSERT INTO {store.database}.{TABLES['spans']} "
        f"(Timestamp, TraceId, SpanId, RolloutId, Attempt, ModelVersion) VALUES {values}"
    )
    batches = [
        TransitionBatch(
            rollout_id=rollout,
            attempt=1,
            task_id="t",
            group_id="g",
            status=RolloutStatus.SUCCEEDED,
            transitions=[
                Transition(
                    rollout_id=rollout,
                    attempt=1,
                    index=index,
                    trace_id="0" * 32,
                    span_id=f"{rollout[:8]}{index:08d}",
                    model_version=version,
                    prompt_token_ids=[1],
                    response_token_ids=[2],
                )
                for r, index, version in calls
                if r == rollout
            ],
        )
        for rollout in (ONE, TWO)
    ]
    rows = [row for batch in batches for row in transition_rows(batch)]
    store.insert_batch(TABLES["transitions"], pa.Table.from_pylist(rows, TRANSITION_SCHEMA))


def test_a_rollout_shows_the_version_its_calls_were_served_by(
    store: Store, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fill(store)
    served = rollout_versions(store, [(ONE, 1), (TWO, 1), (NONE, 1)], store.database)
    assert served == {(ONE, 1): "0", (TWO, 1): "0–1"}
    transitions = store.query(
        f"SELECT RolloutId, min(ModelVersion), max(ModelVersion) FROM {store.database}."
        f"{TABLES['transitions']} GROUP BY RolloutId ORDER BY RolloutId"
    ).rows
    assert transitions == [[ONE, 0, 0], [TWO, 0, 1]]  # what the transitions say is what the rollouts show

    dashboard = DashboardQueries(store)  # read_only=True: through its read-only reader, its database
    shown = {row["RolloutId"]: row["Version"] for row in dashboard.rollouts({})["rollouts"]}
    assert shown == {ONE: "0", TWO: "0–1", NONE: "4"}
    assert [a["Version"] for a in dashboard.rollout({"id": TWO})["attempts"]] == ["0–1"]

    for name, value in {
        "FULMEN_HOME": str(tmp_path),
        "FULMEN_CLICKHOUSE_PATH": str(store.location).removeprefix("chdb://"),
        "FULMEN_CLICKHOUSE_DATABASE": store.database,
        "FULMEN_CLICKHOUSE_READ_PORT": "0",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(base.console, "_width", 100)
    result = CliRunner().invoke(app, ["rollouts", "--wide"])
    assert result.exit_code == 0, result.output
    listed = {
        cells[1].strip(): cells[5].strip()
        for line in result.output.splitlines()
        if (cells := line.split("│")) and len(cells) == 9
    }
    assert listed == {ONE: "0", TWO: "0–1", NONE: "4"}
    one = CliRunner().invoke(app, ["rollouts", TWO[:8]])  # a prefix, resolved by the store
    assert one.exit_code == 0, one.output
    assert f"rollout {TWO}" in one.output
    assert any(line.replace(" ", "").startswith("│version│0–1│") for line in one.output.splitlines()), one.output
