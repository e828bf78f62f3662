"""The three examples end to end through the whole system on the tiny model (``python -m examples.train``).

Each runs two GRPO steps (validation after each) with the real framework in the runners, Kafka from the session's
broker, and everything else started by the driver. The tiny model is first warmed up on the example's teacher
demonstrations of the three training tasks (``fulmen.warmup``; its tokenizer's merges learnt from them; cached
in the test-model cache, ~15 s each on a quiet machine), so the episodes are real ones: tool calls, searches that
find gold documents, the SQL graph's rewrite loop (the third task's demonstration stumbles first), rewards above
0. This checks the plumbing, not learning (``bench/scenarios.py`` measures learning with SmolLM2; the held-out
tasks are never demonstrated and stay unsolved here). While the run's ``fulmen consume`` still serves its store,
SQL checks:

* the framework's own spans are in the spans table (its instrumentation scope);
* the transitions are the trained agents' calls only, in the order they were made: for LangGraph, the
  ``write``/``rewrite`` LLM spans of each rollout in time order (``check`` is left out); for the other two,
  every gateway call of the rollout;
* the rewards: each transition carries its rollout's reward as the episode reward, and its intermediate reward is
  the sum of the ``fulmen.reward`` spans matched to it (the RAG example's search hits; the tiny model rarely
  searches, so they are mostly absent);
* two steps published versions 1 and 2, and the gateway served both (the validation after each step);
* none of it is vacuous: episodes make several calls (SQL: some ``rewrite`` transitions), some rollout is
  rewarded, and for RAG some search hit a gold document and its 0.1 is credited to a call before the answer.

The SQL example trains ``write`` and ``rewrite`` as two LoRA adapters on one frozen base (``--adapters per_agent``,
marker ``multiagent``): after two steps the two adapters differ; every gateway call was served by the adapter of
the node that made it (the nodes' LLM spans and the gateway's spans of each rollout, in time order, by SQL), at
that adapter's version (at version 0 the base may serve a call before the gateway has loaded the adapter's initial
state, which answers the same); ``check`` stayed on the base model (version 0, ``fulmen.llm.adapter`` = base).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from examples.train import ExampleOptions, load_example, sql, train_example
from fulmen.algorithm.local import LocalRun
from fulmen.infra.kafka.local import LocalKafka
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas import semconv

pytestmark = [pytest.mark.scenarios, pytest.mark.timeout(900)]

SCOPES = {
    "sql_agent": "openinference.instrumentation.langchain",
    "rag_agent": "openinference.instrumentation.openai_agents",
    "calc_agent": "autogen-core",
}
WARMUP_CACHE = Path(os.environ.get("FULMEN_TEST_MODEL_CACHE", Path.home() / ".cache" / "fulmen" / "test-models"))
OPTIONS = ExampleOptions(
    model="tiny",
    steps=2,
    train=3,
    heldout=4,
    group_size=3,
    groups_per_step=2,
    max_tokens=64,
    concurrency=12,
    warmup_steps=120,
    warmup_tasks=3,
    warmup_lr=5e-3,
    warmup_cache=WARMUP_CACHE / "examples-warmups",
    extra_train={"val_every": 1},
)
# The calc warm-up needs twice the steps: after 120 its loss was still 0.15 a token and two episodes in three answered
# without calling the calculator (CI once saw no episode of the twelve call it); after 240 it is 0.0003 and each does.
WARMUP_STEPS = {"calc_agent": 240}
# RAG's training questions mix two- and three-hop templates from the first three on: at 5e-3 the loss hovered at
# 0.1-0.2 a token after 120 steps (0.16 after 240) and no episode was rewarded; at 2e-3 it is 0.004 after 120.
WARMUP_LR = {"rag_agent": 2e-3}


def rows(run: LocalRun, query: str) -> list[dict[str, Any]]:
    return sql(run, query)


def check_store(name: str, run: LocalRun, db: str) -> None:
    example = load_example(name)
    scope = rows(run, f"SELECT count() AS n FROM {db}.otel_traces WHERE ScopeName = '{SCOPES[name]}'")
    assert int(scope[0]["n"]) > 0, f"no {SCOPES[name]} spans"
    transitions = rows(
        run,
        f"SELECT RolloutId, Attempt, groupArray(AgentName) AS agents, "
        f"groupArray(EpisodeReward) AS episode, groupArray(coalesce(IntermediateReward, 0.0)) AS intermediate "
        f"FROM (SELECT * FROM {db}.transitions FINAL WHERE Mode = 'train' ORDER BY CallIndex) "
        f"GROUP BY RolloutId, Attempt",
    )
    assert transitions, "no transitions"
    rewards = {
        (r["RolloutId"], int(r["Attempt"])): r["Reward"]
        for r in rows(run, f"SELECT RolloutId, Attempt, Reward FROM {db}.rollouts FINAL WHERE Mode = 'train'")
    }
    expected = expected_agents(name, run, db, example.trained_agents[0])
    for row in transitions:
        key = (row["RolloutId"], int(row["Attempt"]))
        assert set(row["agents"]) <= set(example.trained_agents), row
        assert row["agents"] == expected[key], (key, row["agents"], expected[key])
        assert all(value == rewards[key] for value in row["episode"]), (row, rewards[key])
    hits = {
        (r["RolloutId"], int(r["Attempt"])): float(r["total"])
        for r in rows(
            run,
            f"SELECT RolloutId, Attempt, sum(toFloat64OrZero(SpanAttributes['fulmen.reward.value'])) AS total "
            f"FROM {db}.otel_traces WHERE SpanName = 'fulmen.reward' GROUP BY RolloutId, Attempt",
        )
    }
    for row in transitions:
        key = (row["RolloutId"], int(row["Attempt"]))
        credited = sum(value for value in row["intermediate"] if value is not None)
        assert credited == pytest.approx(hits.get(key, 0.0)), (key, row["intermediate"], hits.get(key))
    assert max(len(row["agents"]) for row in transitions) >= 2, "no episode made two trained calls"
    assert max((r or 0.0) for r in rewards.values()) > 0, "no training rollout was rewarded"
    if name == "sql_agent":
        assert any("rewrite" in row["agents"] for row in transitions), "the rewrite node never ran"
    if name == "rag_agent":  # a search's reward goes to the call that asked for it, never to the answer
        rewarded = [row for row in transitions if any(v for v in row["intermediate"] if v is not None)]
        assert rewarded, "no search found a gold document"
        last = [(row["RolloutId"], row["intermediate"]) for row in rewarded if row["intermediate"][-1]]
        assert not last, f"rewards credited to an episode's last call: {last}"
    served = {
        r["version"]: int(r["calls"])
        for r in rows(
            run,
            f"SELECT toString(ModelVersion) AS version, count() AS calls FROM {db}.otel_traces "
            f"WHERE ServiceName = 'fulmen-llm-gateway' GROUP BY version",
        )
    }
    published = rows(run, f"SELECT groupArray(Version) AS versions FROM {db}.model_versions")
    assert {1, 2} <= {int(v) for v in published[0]["versions"]}, published
    assert served.get("1", 0) > 0 and served.get("2", 0) > 0, served


def check_adapters(run: LocalRun, db: str) -> None:
    """Per-agent adapters (SQL example): each gateway call was served as its node's adapter, the checker's by the
    base model."""
    nodes = rows(
        run,
        f"SELECT RolloutId, Attempt, arrayMap(x -> x.2, arraySort(groupArray((Timestamp, "
        f"JSONExtractString(SpanAttributes['metadata'], 'langgraph_node'))))) AS nodes "
        f"FROM {db}.otel_traces WHERE ScopeName = '{SCOPES['sql_agent']}' "
        f"AND SpanAttributes['openinference.span.kind'] = 'LLM' GROUP BY RolloutId, Attempt",
    )
    served = rows(
        run,
        f"SELECT RolloutId, Attempt, arrayMap(x -> x.2, arraySort(groupArray((Timestamp, "
        f"(SpanAttributes['fulmen.llm.agent'], SpanAttributes['fulmen.llm.adapter'], "
        f"toString(ModelVersion)))))) AS calls FROM {db}.otel_traces "
        f"WHERE ServiceName = 'fulmen-llm-gateway' GROUP BY RolloutId, Attempt",
    )
    by_rollout = {
        (r["RolloutId"], int(r["Attempt"])): [
            (c["1"], c["2"], c["3"]) if isinstance(c, dict) else tuple(c) for c in r["calls"]
        ]
        for r in served
    }  # tuples: JSON objects
    versions: dict[str, set[str]] = {}
    for row in nodes:
        calls = by_rollout[(row["RolloutId"], int(row["Attempt"]))]
        assert [agent for agent, _, _ in calls] == row["nodes"], (row["nodes"], calls)
        for agent, adapter, version in calls:
            if agent == "check" or version != "0":  # at version 0 the base may serve until the adapter is loaded
                assert adapter == (semconv.ADAPTER_NONE if agent == "check" else agent), (agent, adapter, version)
            versions.setdefault(agent, set()).add(version)
    assert versions["check"] == {"0"} and {"1", "2"} <= versions["write"], versions
    published = rows(run, f"SELECT Adapter, groupArray(Version) AS versions FROM {db}.model_versions GROUP BY Adapter")
    assert {r["Adapter"]: sorted(map(int, r["versions"])) for r in published} == {
        "write": [0, 1, 2],
        "rewrite": [0, 1, 2],
    }, published


def adapters_differ(run_dir: Path) -> bool:
    from safetensors.torch import load_file

    last = run_dir / "checkpoints" / "v2"
    write, rewrite = (load_file(last / agent / "adapter_model.safetensors") for agent in ("write", "rewrite"))
    assert set(write) == set(rewrite)
    return any(not write[key].equal(rewrite[key]) for key in write)


def expected_agents(name: str, run: LocalRun, db: str, agent: str) -> dict[tuple[str, int], list[str]]:
    """Per training rollout, the agent names of the calls that must be transitions, in the order they were made."""
    if name == "sql_agent":
        calls = rows(
            run,
            f"SELECT RolloutId, Attempt, arrayMap(x -> x.2, arraySort(groupArray((Timestamp, "
            f"JSONExtractString(SpanAttributes['metadata'], 'langgraph_node'))))) AS nodes "
            f"FROM {db}.otel_traces WHERE ScopeName = '{SCOPES[name]}' "
            f"AND SpanAttributes['openinference.span.kind'] = 'LLM' GROUP BY RolloutId, Attempt",
        )
        return {
            (r["RolloutId"], int(r["Attempt"])): [n for n in r["nodes"] if n in ("write", "rewrite")] for r in calls
        }
    calls = rows(
        run,
        f"SELECT RolloutId, Attempt, count() AS n FROM {db}.otel_traces "
        f"WHERE ServiceName = 'fulmen-llm-gateway' GROUP BY RolloutId, Attempt",
    )
    return {(r["RolloutId"], int(r["Attempt"])): [agent] * int(r["n"]) for r in calls}


@pytest.mark.parametrize("name", [pytest.param("sql_agent", marks=pytest.mark.multiagent), "rag_agent", "calc_agent"])
def test_example_trains_through_the_system(
    name: str, kafka_broker: LocalKafka, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the runners import examples.<name>.agent from here
    settings = FulmenSettings(home=tmp_path, kafka={"bootstrap": kafka_broker.bootstrap})
    checked: list[str] = []

    per_agent = name == "sql_agent"  # write and rewrite as two adapters

    def after(run: LocalRun) -> None:
        check_store(name, run, settings.clickhouse.database)
        if per_agent:
            check_adapters(run, settings.clickhouse.database)
        checked.append(run.run_id)

    options = dataclasses.replace(
        OPTIONS,
        warmup_steps=WARMUP_STEPS.get(name, OPTIONS.warmup_steps),
        warmup_lr=WARMUP_LR.get(name, OPTIONS.warmup_lr),
        adapters="per_agent" if per_agent else OPTIONS.adapters,
    )
    report = train_example(name, options, settings, after=after)
    assert checked, "the store was not checked"
    if per_agent:
        assert adapters_differ(Path(report["run_dir"])), "the write and rewrite adapters are the same after two steps"
    assert report["steps"] == 2 and report["heldout_before"] is not None and report["heldout_after"] is not None
    assert report["calls_per_episode"] and report["calls_per_episode"] <= load_example(name).max_calls, report
    print(json.dumps(report))
