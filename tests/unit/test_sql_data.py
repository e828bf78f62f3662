"""The SQL example's databases and splits: many small generated databases, training on some domains, held out
in distribution (other questions, same databases) and on unseen domains; the agent's prompts show the task's
schema and its queries run on the task's database."""

from __future__ import annotations

import functools
import sqlite3
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from examples.sql_agent import data
from examples.sql_agent.agent import CHECK, REWRITE, WRITE, build_graph
from examples.sql_agent.database import (
    SCHEMA,
    TRAIN_DATABASES,
    UNSEEN_DATABASES,
    database_path,
    domain_of,
    rows_of,
    run_query,
    schema_text,
)
from examples.sql_agent.domains import TRAIN_DOMAINS, UNSEEN_DOMAINS
from examples.sql_agent.reward import reward
from examples.sql_agent.templates import TEMPLATES

pytestmark = pytest.mark.scenarios

SCHEMA_BOUND = 400  # characters: the prompt of a 135M model with a 1024-2048 token context
TRAIN = 2000  # what the benches draw at most


@functools.cache
def splits() -> dict[str, list[dict[str, Any]]]:
    return {
        "train": data.train_tasks(TRAIN),
        "heldout": data.heldout_tasks(data.HELDOUT_SIZE),
        "unseen": data.unseen_tasks(data.UNSEEN_SIZE),
    }


def domain(task: dict[str, Any]) -> str:
    return domain_of(task["db"]).name


def test_the_splits_are_deterministic_and_prefix_stable() -> None:
    assert data.train_tasks(300) == data.train_tasks(300) == splits()["train"][:300]
    assert data.train_tasks(32) == splits()["train"][:32]
    assert data.heldout_tasks(50) == splits()["heldout"][:50] and data.unseen_tasks(50) == splits()["unseen"][:50]


def test_task_inputs_name_their_database_and_template() -> None:
    for name, tasks in splits().items():
        for task in tasks:
            assert set(task) == {"question", "gold_sql", "db", "template"} | ({"greedy"} if name != "train" else set())
            assert task["template"] in TEMPLATES and task["db"] in (*TRAIN_DATABASES, *UNSEEN_DATABASES)
        assert all(t.get("greedy") is True for t in tasks) == (name != "train"), name


def test_held_out_splits_are_disjoint_from_training() -> None:
    train, heldout, unseen = splits()["train"], splits()["heldout"], splits()["unseen"]
    assert not {d.name for d in TRAIN_DOMAINS} & {d.name for d in UNSEEN_DOMAINS}
    assert {domain(t) for t in train} == {domain(t) for t in heldout} == {d.name for d in TRAIN_DOMAINS}
    assert {domain(t) for t in unseen} == {d.name for d in UNSEEN_DOMAINS}  # schemas training never sees
    assert not {t["db"] for t in unseen} & {t["db"] for t in train}
    questions = {t["question"] for t in train}
    assert not questions & {t["question"] for t in heldout} and not questions & {t["question"] for t in unseen}
    assert not {t["question"] for t in heldout} & {t["question"] for t in unseen}
    trained_tables = {table.name for d in TRAIN_DOMAINS for table in d.tables}
    assert not trained_tables & {table.name for d in UNSEEN_DOMAINS for table in d.tables}


def test_each_split_is_large_and_distinct() -> None:
    for name, tasks in splits().items():
        assert len({t["question"] for t in tasks}) == len(tasks), name
    assert data.HELDOUT_SIZE >= 200 and data.UNSEEN_SIZE >= 200
    assert len(splits()["heldout"]) == data.HELDOUT_SIZE and len(splits()["unseen"]) == data.UNSEEN_SIZE
    with pytest.raises(ValueError, match="held-out questions"):
        data.heldout_tasks(data.HELDOUT_SIZE + 1)
    with pytest.raises(ValueError, match="unseen questions"):
        data.unseen_tasks(data.UNSEEN_SIZE + 1)


def test_every_gold_query_runs_and_returns_rows_on_its_database() -> None:
    for name, tasks in splits().items():
        for task in tasks:
            rows = run_query(database_path(task["db"]), task["gold_sql"]).rows
            assert rows and not all(v in (None, 0) for row in rows for v in row), (name, task)
        for task in tasks[:: max(1, len(tasks) // 40)]:
            assert reward(database_path(task["db"]), task["gold_sql"], task["gold_sql"]) == 1.0


def test_every_template_appears_evenly_in_each_split() -> None:
    for name, tasks in splits().items():
        counts = Counter(t["template"] for t in tasks)
        assert set(counts) == set(TEMPLATES), (name, counts)
        assert min(counts.values()) >= 0.9 * len(tasks) / len(TEMPLATES), (name, counts)
        for dom in {domain(t) for t in tasks}:  # each domain asked every kind of question
            assert {t["template"] for t in tasks if domain(t) == dom} == set(TEMPLATES), (name, dom)


def test_the_warm_up_tasks_cover_every_template_evenly() -> None:
    counts = Counter(t["template"] for t in data.train_tasks(32))
    assert set(counts) == set(TEMPLATES) and set(counts.values()) <= {6, 7}, counts
    assert len({domain(t) for t in data.train_tasks(32)}) >= 10


def test_every_schema_is_compact_and_matches_its_database() -> None:
    assert len(TRAIN_DOMAINS) + len(UNSEEN_DOMAINS) >= 10 and len(UNSEEN_DOMAINS) >= 3
    assert schema_text() == schema_text("shop") == SCHEMA
    for db in (*TRAIN_DATABASES, *UNSEEN_DATABASES):
        text = schema_text(db)
        assert len(text) < SCHEMA_BOUND, (db, len(text))
        connection = sqlite3.connect(database_path(db))
        try:
            tables = [r[0] for r in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            assert [line.split("(")[0] for line in text.splitlines()] == tables, db
            lines = dict(zip(tables, text.splitlines(), strict=True))
            keys = [(t, fk) for t in tables for fk in connection.execute(f"PRAGMA foreign_key_list({t})")]
            assert keys and all(f"{fk[3]} -> {fk[2]}.id" in lines[t] for t, fk in keys), db  # real foreign keys
            for table in tables:
                count = connection.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
                assert 8 <= count <= 80 and count == len(rows_of(db)[table]), (db, table, count)
        finally:
            connection.close()


def test_instances_of_a_domain_hold_different_rows() -> None:
    first, second = rows_of("library_1"), rows_of("library_2")
    assert first.keys() == second.keys() and first != second


def test_all_databases_build_quickly_into_a_cache(tmp_path: Path) -> None:
    start = time.monotonic()
    paths = [database_path(db, cache=tmp_path) for db in (None, *TRAIN_DATABASES, *UNSEEN_DATABASES)]
    assert time.monotonic() - start < 10  # well under a second on an idle core
    assert len(set(paths)) == len(paths) and all(p.is_file() and p.parent == tmp_path / "sql_agent" for p in paths)
    assert not list(tmp_path.rglob("*.tmp"))
    assert database_path("zoo_2", cache=tmp_path) == paths[1 + TRAIN_DATABASES.index("zoo_2")]  # built once


def test_unknown_databases_fail_clearly() -> None:
    for bad in ("atlantis_1", "library_9", "library", ""):
        with pytest.raises(ValueError, match="unknown SQL example database"):
            database_path(bad)


def test_the_same_guard_runs_on_every_database() -> None:
    path = database_path(UNSEEN_DATABASES[0])
    for bad in (
        "DELETE FROM ports",
        "DROP TABLE ports",
        "ATTACH DATABASE 'x.db' AS x",
        "PRAGMA writable_schema = 1",
        "SELECT 1; SELECT 2",
    ):
        assert run_query(path, bad).rows is None, bad
    slow = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT COUNT(*) FROM n"
    assert run_query(path, slow, time_limit_s=0.2).error == "query took too long"


# --- the agent on the task's database -------------------------------------------------------------------------


class Chat:
    """A stand-in chat model: records each call's messages, answers with ``answer(system)``."""

    def __init__(self, calls: list[tuple[str, str]], answer: dict[str, str]) -> None:
        self.calls, self.answer = calls, answer

    def invoke(self, messages: list[Any]) -> SimpleNamespace:
        system, user = messages[0].content, messages[-1].content
        self.calls.append((system, user))
        return SimpleNamespace(content=self.answer[system])


def episode(db: str | None, answers: dict[str, str], question: str = "q?") -> list[tuple[str, str]]:
    calls: list[tuple[str, str]] = []
    chats = {node: Chat(calls, answers) for node in ("write", "check", "rewrite")}
    build_graph(chats, db).invoke({"question": question}, {"recursion_limit": 20})  # type: ignore[arg-type]
    return calls


@pytest.mark.parametrize("split", ["train", "unseen"])
def test_the_prompts_show_the_schema_of_the_tasks_database(split: str) -> None:
    task = splits()[split][7]
    others = {schema_text(db) for db in (*TRAIN_DATABASES, *UNSEEN_DATABASES)} - {schema_text(task["db"])}
    calls = episode(
        task["db"], {WRITE: "SELECT * FROM nowhere", CHECK: "wrong", REWRITE: task["gold_sql"]}, task["question"]
    )
    (_, write), *_ = calls
    rewrites = [user for system, user in calls if system == REWRITE]
    assert rewrites and all(schema_text(task["db"]) in user for user in (write, *rewrites))
    assert task["question"] in write and not any(other in write for other in others)
    checks = [user for system, user in calls if system == CHECK]
    assert "error: no such table: nowhere" in checks[0] and "error" not in checks[1]  # the gold ran on that database


def test_a_task_without_a_database_runs_on_the_shop() -> None:
    calls = episode(None, {WRITE: "SELECT COUNT(*) FROM orders", CHECK: "OK", REWRITE: ""})
    assert SCHEMA in calls[0][1] and "[(300,)]" in calls[1][1] and len(calls) == 2


def test_the_teacher_demonstrates_every_template_with_full_reward() -> None:
    from examples.train import load_example
    from fulmen.warmup import Teaching, demonstrations

    example = load_example("sql_agent")
    tasks = data.train_tasks(6) + data.unseen_tasks(2)
    shown = demonstrations(Teaching(example.name, example.agent, example.teacher), tasks)
    assert [d.task for d in shown] == tasks and all(d.reward == 1.0 for d in shown)
    assert {t["template"] for t in tasks} == set(TEMPLATES)
    systems = [[body["messages"][0]["content"] for body, _ in d.calls] for d in shown]
    assert any(REWRITE in s for s in systems) and all(s[0] == WRITE for s in systems)  # the rewrite loop is shown too
