"""The embedded ClickHouse store: migrations, every table through its Arrow batch, deduplication."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from fulmen.consumers.event_sinks import EVENT_SINKS
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import ReadOnlyError, Store
from fulmen.schemas import (
    ModelVersion,
    RolloutEvent,
    RolloutStatus,
    TrainStep,
    Transition,
    TransitionBatch,
)
from fulmen.schemas.ddl import MIGRATIONS, TABLES
from fulmen.schemas.errors import ConfigurationError

pytestmark = pytest.mark.integration

WHEN = datetime(2026, 11, 29, 12, 30, 15, 123456, tzinfo=UTC)
NAIVE_WHEN = WHEN.replace(tzinfo=None)  # clickhouse-connect returns UTC columns as naive UTC datetimes


def _insert(store: Store, sink_name: str, *events: object) -> None:
    sink = EVENT_SINKS[sink_name]
    store.insert_batch(sink.table, sink.to_batch([sink.rows(e) for e in events]))


def test_migrations_are_idempotent(store: Store) -> None:
    assert store.migrate() == []
    assert store.applied_versions() == {m.version for m in MIGRATIONS}
    engines = dict(
        store.query("SELECT name, engine FROM system.tables WHERE database = {db:String}", {"db": store.database}).rows
    )
    for table in TABLES.values():
        assert engines[table] == "ReplacingMergeTree"
    store.command(f"DELETE FROM {store.database}.schema_migrations WHERE Version = 3")  # as if interrupted
    assert [m.version for m in store.migrate()] == [3]
    assert [r[0] for r in store.query(f"SELECT count() FROM {store.database}.schema_migrations").rows] == [
        len(MIGRATIONS)
    ]


def test_rollouts_keep_the_latest_state_per_attempt(store: Store) -> None:
    common = {"rollout_id": "r1", "task_id": "t", "group_id": "g", "timestamp": WHEN}
    events = [
        RolloutEvent(**common, attempt=1, status=RolloutStatus.CLAIMED),
        RolloutEvent(**common, attempt=1, status=RolloutStatus.FAILED, error="boom"),
        RolloutEvent(**common, attempt=2, status=RolloutStatus.RUNNING),
        RolloutEvent(**common, attempt=2, status=RolloutStatus.SUCCEEDED, reward=0.75, model_version=4),
    ]
    _insert(store, "rollouts", *events[:2])
    _insert(store, "rollouts", *reversed(events[2:]))  # the succeeded one first: order must not matter
    _insert(store, "rollouts", events[2])  # a redelivered older state
    rows = store.query(
        f"SELECT Attempt, Status, Reward, Error, ModelVersion, Timestamp FROM {store.database}.rollouts ORDER BY Attempt"
    ).rows
    assert rows == [[1, "failed", None, "boom", None, NAIVE_WHEN], [2, "succeeded", 0.75, "", 4, NAIVE_WHEN]]


def test_transitions_store_token_arrays_exactly(store: Store) -> None:
    calls = [
        Transition(
            rollout_id="r",
            attempt=1,
            index=i,
            trace_id="a" * 32,
            span_id=f"{i:016x}",
            prompt_token_ids=[0, 151_643, 2**31],
            response_token_ids=[i + 1] * (i + 1),
            response_logprobs=[-0.25] * (i + 1),
            reward=0.5 * i,
            agent_name="solver",
        )
        for i in range(3)
    ]
    batch = TransitionBatch(
        rollout_id="r",
        attempt=1,
        task_id="t",
        group_id="g",
        status=RolloutStatus.SUCCEEDED,
        episode_reward=1.0,
        transitions=calls,
        created_at=WHEN,
    )
    _insert(store, "transitions", batch)
    _insert(store, "transitions", batch)  # redelivered
    rows = store.query(
        f"SELECT CallIndex, PromptTokenIds, ResponseTokenIds, ResponseLogprobs, Reward, EpisodeReward, AgentName "
        f"FROM {store.database}.transitions ORDER BY CallIndex"
    ).rows
    assert len(rows) == 3
    assert rows[2] == [2, [0, 151_643, 2**31], [3, 3, 3], [-0.25] * 3, 1.0, 1.0, "solver"]


def test_model_versions_and_train_steps(store: Store) -> None:
    _insert(store, "model_versions", ModelVersion(model_name="m", version=2, uri="/c/2", created_at=WHEN))
    _insert(
        store,
        "train_steps",
        TrainStep(
            run_id="run",
            step=7,
            model_version=2,
            num_transitions=64,
            num_groups=8,
            reward_mean=0.4,
            reward_std=0.2,
            loss=0.1,
            kl=None,
            extra={"grad_norm": 1.5, "lr": 1e-4},
            group_ids=["g-b", "g-a"],
            created_at=WHEN,
        ),
    )
    assert store.query(f"SELECT ModelName, Version, Uri, CreatedAt FROM {store.database}.model_versions").rows == [
        ["m", 2, "/c/2", NAIVE_WHEN]
    ]
    rows = store.query(f"SELECT Step, Kl, Extra['grad_norm'], mapKeys(Extra) FROM {store.database}.train_steps").rows
    assert rows == [[7, None, 1.5, ["grad_norm", "lr"]]]
    assert store.query(f"SELECT GroupIds FROM {store.database}.train_steps").rows == [[["g-b", "g-a"]]]
    # the examples' --replay-store selection, through the read-only guard: the trained groups' rollouts, each with
    # its step and place in the step; g-c was dispatched but never trained on
    rollouts = [
        RolloutEvent(rollout_id=f"r-{g}", task_id="t", group_id=g, attempt=1, status=RolloutStatus.SUCCEEDED)
        for g in ("g-a", "g-b", "g-c")
    ]
    _insert(store, "rollouts", *rollouts)
    from examples.train import REPLAYED

    replayed = REPLAYED.replace("fulmen.", f"{store.database}.")
    assert sorted(store.query(replayed, read_only=True).rows) == [["r-g-a", 700002], ["r-g-b", 700001]]


def test_duplicates_are_invisible_to_system_queries_but_visible_raw(store: Store) -> None:
    event = ModelVersion(model_name="m", version=1, uri="/c/1")
    for _ in range(3):
        _insert(store, "model_versions", event)
    sql = f"SELECT count() FROM {store.database}.model_versions"
    assert store.query(sql).rows == [[1]]
    assert store.query(sql, final=False).rows[0][0] >= 1


@pytest.mark.parametrize(
    "statement",
    [
        "INSERT INTO {db}.model_versions (ModelName) VALUES ('x')",
        "DROP TABLE {db}.model_versions",
        "  /* sneaky */ -- comment\n ALTER TABLE {db}.model_versions DELETE WHERE 1",
        "SET readonly = 0",
        "",
    ],
)
def test_read_only_queries_refuse_writes_and_ddl(store: Store, statement: str) -> None:
    with pytest.raises(ReadOnlyError, match="only reads are allowed|empty statement"):
        store.query(statement.format(db=store.database), read_only=True)
    # Nothing leaked: the process can still write.
    _insert(store, "model_versions", ModelVersion(model_name="m", version=1, uri="/c/1"))
    assert store.query(f"SELECT count() FROM {store.database}.model_versions", read_only=True).rows == [[1]]


def test_reads_never_leave_the_process_read_only(store: Store) -> None:
    for fmt in ("TabSeparated", "ArrowStream", "JSONEachRow"):
        store.reader().raw("SELECT 1", fmt)
    store.query("SELECT 1", read_only=True)
    _insert(store, "model_versions", ModelVersion(model_name="m", version=9, uri="/c/9"))
    assert store.query(f"SELECT Version FROM {store.database}.model_versions").rows == [[9]]
    assert store.query("WITH 1 AS x SELECT x", read_only=True).rows == [[1]]
    assert store.query(f"SHOW TABLES FROM {store.database}", read_only=True).rows


def test_one_store_directory_per_process(store: Store, tmp_path: Path) -> None:
    other = FulmenSettings(home=tmp_path, clickhouse={"path": tmp_path / "elsewhere"})
    with pytest.raises(ConfigurationError, match="one store directory per process"):
        Store.open(other)


def test_a_second_process_gets_a_clear_error(store: Store, store_path: Path) -> None:
    code = (
        "from fulmen.infra.settings import FulmenSettings\n"
        "from fulmen.infra.store import ReadOnlyError, Store\n"
        "from fulmen.schemas.errors import ConfigurationError\n"
        f"try:\n    Store.open(FulmenSettings(clickhouse={{'path': {str(store_path)!r}}}))\n"
        "except ConfigurationError as e:\n    print('CONFIG:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "CONFIG:" in out and "open in another process" in out and "fulmen sql" in out


def test_otel_traces_has_the_collector_exporter_s_columns_and_types(store: Store) -> None:
    """Every column of the Collector's ClickHouse exporter's traces table is in ``otel_traces`` with its type
    (``DateTime64(9, 'UTC')`` for its ``DateTime64(9)``: Fulmen pins the time zone), so Grafana's ClickHouse trace
    views and the exporter's queries work on it; the derived attribute items read as the exporter's do."""
    from tests.fixtures.collector_clickhouse_traces import COLUMNS

    described = {row[0]: row[1] for row in store.query(f"DESCRIBE TABLE {store.database}.otel_traces").rows}
    ours = {name: kind.replace("DateTime64(9, 'UTC')", "DateTime64(9)") for name, kind in described.items()}
    assert {name: ours.get(name) for name in COLUMNS} == COLUMNS
    store.command(
        f"INSERT INTO {store.database}.otel_traces (TraceId, SpanId, SpanAttributes) "
        "VALUES ('t', 's', map('gen_ai.system', 'fulmen', 'k', 'v'))"
    )
    items = store.query(f"SELECT SpanAttributeItems FROM {store.database}.otel_traces WHERE TraceId = 't'").rows
    assert [list(row) for row in items] == [[["gen_ai.system=fulmen", "k=v"]]]


def test_the_embedded_engine_runs_with_bounded_caches_and_spans_writers(store: Store) -> None:
    """The engine options of ClickHouseSettings reach the engine; the spans table's writers are bounded."""
    server = dict(
        store.query(
            "SELECT name, value FROM system.server_settings WHERE name IN ('mark_cache_size', 'max_server_memory_usage')"
        ).rows
    )
    assert int(server["mark_cache_size"]) == store.settings.engine_cache_bytes
    assert int(server["max_server_memory_usage"]) == store.settings.engine_max_memory_bytes
    ddl = store.query(
        "SELECT create_table_query FROM system.tables WHERE database = {db:String} AND name = 'otel_traces'",
        {"db": store.database},
    ).rows[0][0]
    assert f"max_compress_block_size = {store.settings.engine_compress_block_bytes}" in ddl
    assert "vertical_merge_algorithm_min_rows_to_activate = 1" in ddl


def test_a_long_array_parameter_finds_its_rows(store: Store) -> None:
    ids = [f"r-{i}'" for i in range(200)]  # quotes in them: the literal escapes them
    rows = store.query(
        "SELECT count() FROM numbers(1) WHERE concat('r-', '7', '''') IN {ids:Array(String)}", {"ids": ids}, final=False
    ).rows
    keys = [(f"r-{i}'", i) for i in range(200)]
    found = store.query("SELECT ('r-7''', 7) IN {keys:Array(Tuple(String, UInt32))}", {"keys": keys}, final=False)
    assert rows == [[1]] and found.rows == [[1]]
