"""The learning protocol's parts that need no model: the calc splits (unseen shapes), the failure kinds, outcomes
filed by split and version, and the arithmetic of bench/scenario_stats.py."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from bench.scenario_stats import (
    before_after,
    by_template,
    failure_counts,
    pooled_gain,
    ratio_interval,
    seed_interval,
)
from examples.calc_agent import data
from examples.calc_agent.failures import failure_kind
from examples.outcomes import Episode, outcomes_by_split
from examples.train import ExampleOptions, dataset, load_example

pytestmark = pytest.mark.scenarios


def test_calc_warm_up_tasks_cover_every_template_and_unseen_shapes_are_never_trained_on() -> None:
    warm_up = Counter(t["template"] for t in data.train_tasks(32))
    assert set(warm_up) == set(data.TEMPLATES) and min(warm_up.values()) >= 4
    unseen = data.unseen_tasks(200)
    assert unseen == data.unseen_tasks(200) and len({t["question"] for t in unseen}) == 200
    assert all(t["greedy"] for t in unseen)
    train = data.train_tasks(10_000)
    assert {t["template"] for t in train} == set(data.TEMPLATES)  # training never draws an unseen family
    assert not {t["question"] for t in train} & {t["question"] for t in unseen}
    families = Counter(t["template"] for t in unseen)
    assert set(data.UNSEEN_TEMPLATES) <= set(families) and len(data.UNSEEN_TEMPLATES) >= 3
    large = [t for t in unseen if t["template"].endswith("-large")]
    assert large and max(t["answer"] for t in large) > max(t["answer"] for t in train)
    heldout = data.heldout_tasks(200)
    assert Counter(t["template"] for t in heldout).keys() == set(data.TEMPLATES)


def test_every_calc_problem_is_whole_and_its_expression_gives_the_answer() -> None:
    from examples.calc_agent.calculator import calculate

    for task in data.unseen_tasks(300) + data.train_tasks(300):
        assert calculate(task["expression"]) == task["answer"] >= 0


def _episode(outputs: list[dict], status: str = "succeeded", reward: float = 0.0) -> Episode:
    return Episode("t", "0", status, reward, outputs)


def _call(expression: str) -> dict:
    arguments = json.dumps({"expression": expression})
    return {"role": "assistant", "tool_calls": [{"function": {"name": "calculator", "arguments": arguments}}]}


@pytest.mark.parametrize(
    ("outputs", "status", "reward", "kind"),
    [
        ([_call("3*4"), {"content": "12"}], "succeeded", 1.0, "correct"),
        ([], "timed_out", 0.0, "timed_out"),
        ([{"content": "It is 13."}], "succeeded", 0.0, "no_tool_call"),
        ([_call("three times four")], "succeeded", 0.0, "bad_expression"),
        ([_call("3+4"), {"content": "7"}], "succeeded", 0.0, "wrong_expression"),
        ([_call("3*4"), _call("3*4")], "succeeded", 0.0, "no_answer"),
        ([_call("3*4"), {"content": "12 pens for 3 friends"}], "succeeded", 0.0, "extra_numbers"),
        ([_call("3*4"), {"content": "The answer is 7"}], "succeeded", 0.0, "wrong_final_answer"),
    ],
)
def test_calc_failure_kinds(outputs: list[dict], status: str, reward: float, kind: str) -> None:
    assert failure_kind({"answer": 12}, _episode(outputs, status, reward)) == kind


def test_outcomes_are_filed_by_split_and_version_with_missing_episodes_unsolved() -> None:
    example = load_example("calc_agent")
    splits = dataset(example, ExampleOptions(train=4, heldout=3, unseen=2))
    first, second = splits.heldout[0].task_id, splits.unseen[1].task_id
    episodes = [
        Episode(first, "0", "succeeded", 0.0, [{"content": "no idea"}]),
        Episode(first, "2", "succeeded", 1.0),
        Episode(second, "2", "timed_out", 0.0),
    ]
    outcomes = outcomes_by_split(example, splits, episodes)["outcomes"]
    assert outcomes["heldout"]["by_version"]["0"] == {
        "solved": [False] * 3,
        "failures": ["no_tool_call", "missing", "missing"],
        "rewards": [0.0, 0.0, 0.0],
    }
    assert outcomes["heldout"]["by_version"]["2"]["rewards"] == [1.0, 0.0, 0.0]
    assert outcomes["heldout"]["by_version"]["2"]["solved"] == [True, False, False]
    assert outcomes["unseen"]["by_version"]["2"]["failures"] == ["missing", "timed_out"]
    assert outcomes["unseen"]["templates"] == [t.input["template"] for t in splits.unseen]


def test_pooled_gain_averages_seeds_per_task_and_stays_inside_what_a_share_can_be() -> None:
    same = pooled_gain([([False] * 10, [True] * 10)] * 3)
    assert same == {"gain": 1.0, "ci95": [1.0, 1.0], "n": 10}
    mixed = pooled_gain(
        [
            ([False, False, True, True], [True, False, True, False]),
            ([False, False, True, True], [True, True, True, True]),
        ]
    )
    assert mixed["gain"] == pytest.approx(0.25) and mixed["ci95"][0] < 0.25 < mixed["ci95"][1]
    assert mixed["ci95"][0] >= -1.0 and mixed["ci95"][1] <= 1.0
    with pytest.raises(ValueError):
        pooled_gain([([True], [True]), ([True, False], [True, False])])
    assert seed_interval([0.1]) is None
    low, high = seed_interval([0.1, 0.2, 0.3])
    assert low < 0.2 < high


def test_breakdowns_by_template_and_failure_kind() -> None:
    runs = [([False, True, False], [True, True, False])]
    table = by_template(["a", "b", "a"], runs)
    assert table == {"a": {"n": 2, "before": 0.0, "after": 0.5}, "b": {"n": 1, "before": 1.0, "after": 1.0}}
    assert failure_counts([["correct", "wrong"], ["wrong", "wrong"]]) == {"wrong": 1.5, "correct": 0.5}
    split = {"by_version": {"10": {"solved": [True]}, "0": {"solved": [False]}, "5": {"solved": [False]}}}
    assert before_after(split) == ([False], [True])  # versions in number order, not text order
    assert before_after({"by_version": {"0": {"solved": [True]}}}) is None


def test_the_scenarios_summary_pools_seeds_and_reads_the_baselines_from_their_parts() -> None:
    from bench.scenarios import compact, markdown, summary, tokens_of_real_runs

    def part(before: list[bool], after: list[bool] | None, **figures: object) -> dict:
        versions = {"0": before} | ({"20": after} if after is not None else {})
        outcomes = {
            split: {
                "tasks": ["a", "b"],
                "templates": ["buy", "area"],
                "by_version": {
                    v: {"solved": s, "failures": ["correct" if x else "no_tool_call" for x in s]}
                    for v, s in versions.items()
                },
            }
            for split in ("heldout", "unseen")
        }
        return {"outcomes": compact({"outcomes": outcomes}), **figures}

    runs = {
        "real/0": part([False, True], [True, True], steps=20, tokens_trained_per_step=600, s_per_step=25.0),
        "real/1": part([False, True], [False, True], steps=20, tokens_trained_per_step=700, s_per_step=27.0),
        "control/0": part([True, True], [False, True]),
        "sft/0": part([True, False], None, sft_tokens=13_000),
        "zero_shot/0": part([False, False], None),
    }
    assert tokens_of_real_runs(runs) == 13_000
    figures = summary("calc_agent", runs)
    assert figures["seeds"] == 2 and figures["gain_by_seed"] == [0.5, 0.0]
    assert figures["heldout_before"] == 0.5 and figures["heldout_after"] == 0.75 and figures["heldout_n"] == 2
    assert figures["control_delta"] == -0.5 and figures["sft_baseline_after"] == 0.5 and figures["zero_shot"] == 0.0
    assert figures["by_template"]["unseen"]["buy"] == {"n": 1, "before": 0.0, "after": 0.5}
    assert figures["failures_before"]["heldout"] == {"no_tool_call": 1.0, "correct": 1.0}
    assert (
        figures["failures_after"]["unseen"] == {"correct": 1.5, "no_tool_call": 0.5} and figures["s_per_step"] == 26.0
    )
    table = markdown("calc_agent", figures)
    assert (
        "| held-out, in distribution (n=2) | 50.0% | 75.0% | +25.0 |" in table
        and "zero-shot (no warm-up) 0.0%" in table
    )
    assert "| unseen | `buy` | 1 | 0.0% | 50.0% |" in table
    assert "heldout_reward_before" not in figures  # no part kept its rewards
    assert figures["replay_fraction"] is None and figures["replay_seeds"] == 0  # no replay arm yet
    runs["replay/0"] = part([False, True], [True, True])  # replay got what real/0 got
    replayed = summary("calc_agent", runs)
    assert replayed["replay_seeds"] == 1 and replayed["replay_fraction"] == 1.0 and replayed["replay_gain"] == 0.5


def test_the_summary_means_the_episode_rewards_of_the_runs_that_kept_them() -> None:
    from bench.scenarios import compact, expand, summary

    def part(rewards: dict[str, list[float]]) -> dict:
        by_version = {
            v: {"solved": [r >= 1 for r in rs], "failures": ["x"] * len(rs), "rewards": rs} for v, rs in rewards.items()
        }
        outcomes = {"heldout": {"tasks": ["a", "b"], "templates": ["t", "t"], "by_version": by_version}}
        return {"outcomes": compact({"outcomes": outcomes})}

    kept = part({"0": [0.5, 1.0], "20": [1.0, 1.0]})
    assert expand(kept["outcomes"])["heldout"]["by_version"]["20"] == {
        "solved": [True, True],
        "failures": ["x", "x"],
        "rewards": [1.0, 1.0],
    }
    figures = summary("rag_agent", {"real/0": kept, "real/1": part({"0": [0.0, 0.5], "20": [0.5, 0.5]})})
    assert figures["heldout_reward_before"] == 0.5 and figures["heldout_reward_after"] == 0.75  # F1 for RAG


def test_the_replay_fraction_is_a_ratio_of_gains_on_the_same_tasks_with_a_paired_bootstrap_interval() -> None:
    before = [False] * 100 + [True] * 100
    on_policy = [True] * 150 + [False] * 50  # +100 -50: +0.25
    replay = [True] * 130 + [False] * 70  # +100 -70: +0.15
    found = ratio_interval([(before, replay)], [(before, on_policy)])
    assert found["ratio"] == 0.6 and found["ci95"][0] < 0.6 < found["ci95"][1]
    assert ratio_interval([(before, replay)], [(before, before)]) == {"ratio": None, "ci95": None}  # no gain to share
    with pytest.raises(ValueError):
        ratio_interval([([True], [True])], [(before, on_policy)])


def _search(query: str) -> dict:
    arguments = json.dumps({"query": query})
    return {"role": "assistant", "tool_calls": [{"function": {"name": "search", "arguments": arguments}}]}


def test_rag_failure_kinds_follow_the_gold_path() -> None:
    from examples.rag_agent import data as rag_data
    from examples.rag_agent.failures import failure_kind as rag_kind
    from examples.rag_agent.teacher import queries

    task = next(t for t in rag_data.heldout_tasks(20) if t["hops"] == 3)
    first, second, third = (_search(q) for q in queries(task))
    astray = _search("zzzz unknown words")
    answer = {"role": "assistant", "content": "Somewhere"}
    cases = {
        "correct": ([first, second, third, {"content": task["answer"]}], "succeeded", 1.0),
        "timed_out": ([first], "timed_out", 0.0),
        "no_search": ([answer], "succeeded", 0.0),
        "out_of_turns": ([first, second, astray, astray], "succeeded", 0.0),
        "lost_path": ([first, astray, answer], "succeeded", 0.0),
        "answered_early": ([first, second, answer], "succeeded", 0.0),
        "no_answer": ([first, second, third, third], "succeeded", 0.0),
        "wrong_answer": ([first, second, third, answer], "succeeded", 0.0),
    }
    for kind, (outputs, status, reward) in cases.items():
        assert rag_kind(task, _episode(outputs, status, reward)) == kind, kind


def test_reclassify_reads_a_kept_store_again_with_the_examples_failure_kinds(tmp_path, monkeypatch) -> None:
    import examples.train
    from bench.scenarios import reclassified
    from examples.rag_agent import data as rag_data
    from examples.rag_agent.teacher import queries

    assert reclassified("rag_agent", {"run_dir": str(tmp_path / "gone")}) is None
    (tmp_path / "chdb").mkdir()
    task = examples.train.dataset(load_example("rag_agent"), ExampleOptions(train=4, heldout=2, unseen=0)).heldout[1]
    searched = [_search(q) for q in queries(task.input)[:2]]

    def sql(reader, query: str) -> list[dict]:
        assert reader.env == {"FULMEN_CLICKHOUSE_PATH": str(tmp_path / "chdb")}
        if "FROM fulmen.rollouts FINAL" in query:
            return [
                {
                    "rollout": "r",
                    "version": "0",
                    "task": task.task_id,
                    "status": "succeeded",
                    "reward": 0.0,
                    "attempt": 1,
                }
            ]
        return [{"rollout": "r", "attempt": 1, "outputs": [json.dumps([m]) for m in [*searched, {"content": "x"}]]}]

    monkeypatch.setattr(examples.train, "sql", sql)
    run = {"run_dir": str(tmp_path), "settings": {"train": 4, "heldout": 2, "unseen": 0}}
    kept = reclassified("rag_agent", run)
    assert rag_data.heldout_tasks(2)[1]["hops"] == 3
    assert kept["heldout"]["by_version"]["0"]["failures"] == ["missing", "answered_early"]
