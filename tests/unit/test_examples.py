"""The three examples' parts: data (deterministic, splits disjoint), rewards, tools, and each agent against the
stand-in OpenAI server, run as the runner runs it (``tests.unit.test_framework_agents.run_rollout``)."""

from __future__ import annotations

import json
import sqlite3
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from examples.calc_agent.calculator import CalcError, calculate
from examples.calc_agent.reward import reward as calc_reward
from examples.rag_agent.reward import token_f1
from examples.rag_agent.search import search
from examples.spec import write_splits
from examples.sql_agent.agent import extract_sql
from examples.sql_agent.database import database_path, run_query
from examples.sql_agent.reward import reward as sql_reward
from examples.train import EXAMPLES, load_example
from fulmen.schemas import semconv
from fulmen.schemas.task_file import load_task_file
from tests.agents.frameworks.fake_openai import SCRIPTS, FakeOpenAI, Reply, ToolCall
from tests.unit.test_framework_agents import exporter, run_rollout  # noqa: F401  (the fixture and the helper)

pytestmark = [pytest.mark.scenarios, pytest.mark.frameworks]


@pytest.mark.parametrize("name", EXAMPLES)
def test_data_is_deterministic_and_held_out_questions_are_never_trained_on(name: str, tmp_path: Path) -> None:
    example = load_example(name)
    train, heldout = example.train_tasks(200), example.heldout_tasks(16)
    assert train == example.train_tasks(200) and heldout == example.heldout_tasks(16)
    assert len(train) == 200 and len(heldout) == 16
    assert all(t.get("greedy") for t in heldout) and not any(t.get("greedy") for t in train)
    assert not {t["question"] for t in train} & {t["question"] for t in heldout}
    write_splits(tmp_path, train[:5], heldout[:3])  # the task files `fulmen train` reads
    assert [t.input for t in load_task_file(tmp_path / "train.jsonl")] == train[:5]
    assert len(load_task_file(tmp_path / "val.jsonl")) == 3


@pytest.mark.parametrize("name", EXAMPLES)
def test_both_held_out_splits_have_200_problems_never_trained_on_each_naming_its_template(name: str) -> None:
    example = load_example(name)
    assert example.unseen_tasks is not None
    train, heldout, unseen = example.train_tasks(2000), example.heldout_tasks(200), example.unseen_tasks(200)
    for split in (heldout, unseen):
        assert len({t["question"] for t in split}) == 200 and all(t.get("greedy") for t in split)
        assert not {t["question"] for t in train} & {t["question"] for t in split}
    assert all(t.get("template") for t in train[:200] + heldout + unseen)

    def shape(task: dict[str, Any]) -> tuple[str, str]:  # the question family, and the schema's domain (SQL)
        return task["template"], str(task.get("db", "")).rsplit("_", 1)[0]

    assert not {shape(t) for t in unseen} & {shape(t) for t in train}  # shapes training never drew


def test_calculator_is_exact_and_refuses_what_is_not_arithmetic() -> None:
    assert calculate("12*8-30") == 66 and calculate("7/2*2") == 7 and calculate("(1+2)**3 % 5") == 2
    assert calculate("1/3") == Fraction(1, 3) and calculate("2^3") == 8
    for bad in ("__import__('os')", "a+1", "1/0", "9**99", "10**10*10**10", "", "1" * 300, "[1]", "len('x')"):
        with pytest.raises(CalcError):
            calculate(bad)


def test_calc_reward_reads_the_last_number() -> None:
    assert calc_reward("so 12 - 3 = 9", 9) == 1.0 and calc_reward("It is 1,234.", 1234) == 1.0
    assert calc_reward("12.0", 12) == 1.0 and calc_reward("9 or 10", 9) == 0.0 and calc_reward("none", 9) == 0.0


def test_sql_queries_run_read_only_with_a_time_limit_and_never_raise() -> None:
    path = database_path()
    assert run_query(path, "SELECT COUNT(*) FROM orders").rows == [(300,)]
    for bad in (
        "DELETE FROM orders",
        "DROP TABLE orders",
        "SELEC nothing",
        "",
        "SELECT 1; SELECT 2",
        "ATTACH DATABASE 'x.db' AS x",
    ):
        assert run_query(path, bad).rows is None, bad
    slow = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT COUNT(*) FROM n"
    assert run_query(path, slow, time_limit_s=0.2).error == "query took too long"
    assert sqlite3.connect(path).execute("SELECT COUNT(*) FROM orders").fetchone() == (300,)  # untouched


def test_sql_reward_compares_results_not_text() -> None:
    path, gold = database_path(), "SELECT name FROM products WHERE price > 50"
    assert sql_reward(path, "select p.name from products p where 50 < p.price order by name", gold) == 1.0
    assert sql_reward(path, "SELECT name FROM products", gold) == 0.0
    assert sql_reward(path, "not sql at all", gold) == 0.0
    assert extract_sql("Sure!\n```sql\nSELECT 1;\n```") == "SELECT 1"
    assert extract_sql("The query is SELECT name FROM products; done") == "SELECT name FROM products"


def test_rag_search_ranks_by_bm25_and_survives_any_query() -> None:
    task = load_example("rag_agent").train_tasks(1)[0]
    person_doc = task["gold_docs"][0]
    assert search(task["question"])[0][0] == person_doc  # the person's name is the rarest term
    for query in ('"unbalanced', "NEAR(a b", "*", "", "AND OR NOT", "x" * 5000, "ÿ😀"):
        assert isinstance(search(query), list)
    assert token_f1("The Zibrou River", "the Zibrou River") == 1.0 and token_f1("Zibrou", "the Zibrou River") == 1.0
    assert token_f1("a river", "the Zibrou River") == 0.0  # the question's category word earns nothing
    assert token_f1("Zibrou or Tatu", "the Zibrou River") == 0.5 and token_f1("", "x") == 0.0


# --- the agents against the stand-in server ----------------------------------------------------------------


def _names(rollout: Any, key: str) -> list[str]:
    return [s.attributes.get(key) for s in rollout.spans if s.attributes and s.attributes.get(key)]


@pytest.mark.parametrize("script", ["tool_then_text", "garbage"])
async def test_sql_agent_nodes_are_named_and_bounded(exporter, script: str) -> None:  # noqa: F811
    from examples.sql_agent.agent import MAX_CALLS, run

    task = load_example("sql_agent").train_tasks(1)[0]
    with FakeOpenAI(script) as server:
        rollout = await run_rollout(exporter, server, run, task, f"sql-{script}")
    assert rollout.reward == 0.0 and 2 <= len(rollout.requests) <= MAX_CALLS
    nodes = [
        json.loads(s.attributes[semconv.OPENINFERENCE_METADATA])["langgraph_node"]
        for s in rollout.spans
        if (s.attributes or {}).get("openinference.span.kind") == "LLM"
    ]
    assert nodes[:2] == ["write", "check"] and set(nodes) <= {"write", "check", "rewrite"}
    assert len(nodes) == len(rollout.requests)


async def test_sql_agent_gets_the_reward_for_the_right_query(exporter, monkeypatch) -> None:  # noqa: F811
    from examples.sql_agent.agent import run

    task = load_example("sql_agent").train_tasks(1)[0]
    monkeypatch.setitem(
        SCRIPTS,
        "gold",
        lambda body: Reply(content="OK" if "review" in json.dumps(body) else f"```sql\n{task['gold_sql']}\n```"),
    )
    with FakeOpenAI("gold") as server:
        rollout = await run_rollout(exporter, server, run, task, "sql-gold")
    assert rollout.reward == 1.0 and len(rollout.requests) == 2  # write, then check says OK


async def test_rag_agent_rewards_a_search_that_finds_a_gold_document(exporter, monkeypatch) -> None:  # noqa: F811
    from examples.rag_agent.agent import run

    task = load_example("rag_agent").train_tasks(1)[0]
    person = task["question"].split("where ")[-1].removesuffix(" was born?")

    def script(body: dict[str, Any]) -> Reply:
        if body["messages"][-1]["role"] == "tool":
            return Reply(content=task["answer"])
        return Reply(tool_calls=(ToolCall("search", json.dumps({"query": person})),))

    monkeypatch.setitem(SCRIPTS, "rag", script)
    with FakeOpenAI("rag") as server:
        rollout = await run_rollout(exporter, server, run, task, "rag-hit")
    assert rollout.reward == 1.0 and len(rollout.requests) == 2
    rewards = [s for s in rollout.spans if s.name == semconv.SPAN_REWARD]
    assert [r.attributes[semconv.REWARD_VALUE] for r in rewards] == [0.1]
    tool = next(s for s in rollout.spans if (s.attributes or {}).get("tool.name") == "search")
    assert rewards[0].start_time >= tool.start_time  # after the call that asked for the search
    assert "researcher" in _names(rollout, "agent.name")


@pytest.mark.parametrize("script", ["garbage", "bad_arguments"])
async def test_rag_agent_survives_noise(exporter, script: str) -> None:  # noqa: F811
    from examples.rag_agent.agent import MAX_TURNS, run

    task = load_example("rag_agent").heldout_tasks(1)[0]
    with FakeOpenAI(script) as server:
        rollout = await run_rollout(exporter, server, run, task, f"rag-{script}")
    assert rollout.reward == 0.0 and 1 <= len(rollout.requests) <= MAX_TURNS


@pytest.mark.parametrize("script", ["tool_then_text", "garbage", "bad_arguments"])
async def test_calc_agent_is_named_and_bounded(exporter, script: str) -> None:  # noqa: F811
    from examples.calc_agent.agent import MAX_CALLS, run

    task = load_example("calc_agent").train_tasks(1)[0]
    with FakeOpenAI(script) as server:
        rollout = await run_rollout(exporter, server, run, task, f"calc-{script}")
    assert rollout.reward in (0.0, 1.0) and 1 <= len(rollout.requests) <= MAX_CALLS
    assert "solver" in _names(rollout, "gen_ai.agent.name")
    assert all(r.body.get("temperature") == 1.0 for r in rollout.requests)


async def test_calc_agent_uses_the_calculator_and_answers(exporter, monkeypatch) -> None:  # noqa: F811
    from examples.calc_agent.agent import run

    task = {"question": "What is 12 times 8 minus 30?", "answer": 66, "greedy": True}

    def script(body: dict[str, Any]) -> Reply:
        last = body["messages"][-1]
        if last["role"] == "tool":
            return Reply(content=f"The answer is {last['content']}.")
        return Reply(tool_calls=(ToolCall("calculator", json.dumps({"expression": "12*8-30"})),))

    monkeypatch.setitem(SCRIPTS, "calc", script)
    with FakeOpenAI("calc") as server:
        rollout = await run_rollout(exporter, server, run, task, "calc-right")
    assert rollout.reward == 1.0 and len(rollout.requests) == 2
    assert all(r.body.get("temperature") == 0.0 for r in rollout.requests)
