"""The prompt searches over a fake evaluator (a table of rewards per text and task) and a scripted proposer."""

from __future__ import annotations

import pytest

from fulmen.algorithm.prompts import (
    BudgetExhausted,
    Candidate,
    Episode,
    OptimizerExhausted,
    Proposal,
    RolloutBudget,
    Scorer,
    SearchConfig,
    candidate_id,
    frontier,
    gepa,
    optimize,
)
from fulmen.algorithm.prompts.search import beam, get_search
from fulmen.schemas.errors import ConfigurationError

pytestmark = pytest.mark.apo

TRAIN = [f"t{i}" for i in range(8)]
VAL = [f"v{i}" for i in range(4)]
TEST = [f"x{i}" for i in range(4)]
BASE = {"sys": "base"}


class TableEvaluator:
    """reward = table[text][task prefix] (default 0); records every dispatch."""

    def __init__(self, table: dict[str, dict[str, float]]) -> None:
        self.table = table
        self.calls: list[tuple[str, list[str]]] = []

    def run(self, slots, task_ids):
        self.calls.append((slots["sys"], list(task_ids)))
        row = self.table.get(slots["sys"], {})
        return [Episode(t, row.get(t, row.get(t[0], 0.0)), f"r-{len(self.calls)}-{t}", f"failed {t}") for t in task_ids]


class ScriptedProposer:
    """Proposes the script's texts in order, skipping those the search says it refused."""

    def __init__(self, script: list[str], tokens: int | None = None) -> None:
        self.script = list(script)
        self.requests = []
        self.tokens = tokens

    def propose(self, request):
        self.requests.append(request)
        if self.tokens is not None:
            if self.tokens <= 0:
                raise OptimizerExhausted("token cap")
            self.tokens -= 10
        for text in self.script:
            if all(text not in request.rejected[s] for s in request.slots) and text != request.parent["sys"]:
                self.script.remove(text)
                return Proposal({s: text for s in request.slots}, tokens=10)
        return Proposal(None)


# "good" succeeds everywhere, "half" on v/x/t tasks with even index via explicit rows, "bad" nowhere
TABLE = {
    "base": {"t": 0.0, "v": 0.0, "x": 0.0},
    "bad": {"t": 0.0, "v": 0.0, "x": 0.0},
    "good": {"t": 1.0, "v": 1.0, "x": 1.0},
}


def test_budget_refuses_before_anything_runs():
    ev = TableEvaluator(TABLE)
    scorer = Scorer(ev, RolloutBudget(5))
    scorer.run(BASE, VAL)
    with pytest.raises(BudgetExhausted):
        scorer.run(BASE, VAL)
    assert scorer.budget.used == 4
    assert len(ev.calls) == 1  # the refused dispatch never reached the evaluator


def test_frontier_counts_tasks_led_with_ties():
    a = Candidate("a", {}, [], {"v0": 1, "v1": 0, "v2": 0.5})
    b = Candidate("b", {}, [], {"v0": 0, "v1": 1, "v2": 0.5})
    c = Candidate("c", {}, [], {"v0": 0, "v1": 0, "v2": 0.2})
    assert frontier([a, b, c], ["v0", "v1", "v2"]) == {"a": 2, "b": 2}


def test_gepa_accepts_only_a_child_that_beats_its_parent_on_the_same_minibatch():
    ev = TableEvaluator(TABLE)
    prop = ScriptedProposer(["bad", "good"])
    result = gepa(Scorer(ev, RolloutBudget(60)), prop, BASE, TRAIN, VAL, SearchConfig(seed=1, minibatch=2))
    assert [c.slots["sys"] for c in result.candidates] == ["base", "good"]
    assert result.best.slots == {"sys": "good"} and result.best.parents == [candidate_id(BASE)]
    why = result.best.accepted_by
    assert why["child_sum"] > why["parent_sum"]
    # the child ran on exactly the parent's minibatch
    runs = [(text, tasks) for text, tasks in ev.calls if tasks == why["minibatch"]]
    assert [t for t, _ in runs][-2:] == ["base", "good"]
    # "bad" was refused (tie on the minibatch is not a win) and remembered: later requests carry it
    assert result.rejected and result.rejected[0]["child_sum"] == result.rejected[0]["parent_sum"]
    assert "bad" in prop.requests[-1].rejected["sys"]
    assert result.rollouts_to_best == result.best.found_at_rollouts <= result.rollouts_used
    assert result.stopped_by == "solved"  # "good" succeeds on every validation task: no rollout spent after it
    assert result.rollouts_used == result.rollouts_to_best


def test_gepa_never_exceeds_the_budget_and_stops_on_it():
    for budget in range(4, 30):
        ev = TableEvaluator(TABLE)
        result = gepa(
            Scorer(ev, RolloutBudget(budget)),
            ScriptedProposer(["bad"] * 50),
            BASE,
            TRAIN,
            VAL,
            SearchConfig(minibatch=3),
        )
        dispatched = sum(len(tasks) for _, tasks in ev.calls)
        assert dispatched == result.rollouts_used <= budget


def test_gepa_stops_at_the_optimiser_token_cap():
    result = gepa(
        Scorer(TableEvaluator(TABLE), RolloutBudget(1000)),
        ScriptedProposer(["bad"] * 99, tokens=30),
        BASE,
        TRAIN,
        VAL,
        SearchConfig(),
    )
    assert result.stopped_by == "OptimizerExhausted"


def _lineage(seed: int, search: str = "gepa"):
    table = {f"p{i}": {t: float((i * 7 + int(t[1:])) % 3 == 0) for t in TRAIN + VAL + TEST} for i in range(12)}
    table["base"] = {}
    script = [f"p{i}" for i in range(12)]
    cfg = SearchConfig(seed=seed, minibatch=3, width=2, branch=2, rounds=3)
    return optimize(
        TableEvaluator(table),
        ScriptedProposer(script),
        BASE,
        train=TRAIN,
        val=VAL,
        test=TEST,
        max_rollouts=80,
        search=search,
        config=cfg,
    )


@pytest.mark.parametrize("search", ["gepa", "beam"])
def test_same_seed_same_lineage(search):
    runs = [_lineage(3, search) for _ in range(3)]
    assert runs[0].lineage() == runs[1].lineage() == runs[2].lineage()
    assert len(runs[0].candidates) > 1
    if search == "gepa":
        assert any(_lineage(s).lineage() != runs[0].lineage() for s in range(4, 10))


def test_report_is_on_the_test_split_within_the_budget():
    ev = TableEvaluator({**TABLE, "good": {"t": 1.0, "v": 1.0, "x": 0.5}})
    result = optimize(
        ev,
        ScriptedProposer(["good"]),
        BASE,
        train=TRAIN,
        val=VAL,
        test=TEST,
        max_rollouts=40,
        config=SearchConfig(minibatch=2),
    )
    assert result.report["heldout_before"] == 0.0
    assert result.report["heldout_after"] == 0.5  # the test score, not the validation score (1.0)
    assert result.best.mean == 1.0
    assert ev.calls[-1] == ("good", TEST) and ev.calls[-2] == ("base", TEST)
    assert result.report["rollouts_used"] == sum(len(t) for _, t in ev.calls) <= 40
    assert not any(task.startswith("x") for _, tasks in ev.calls[:-2] for task in tasks)


def test_beam_keeps_the_top_width_and_records_rounds():
    table = {"base": {}, "a": {"v": 0.5}, "b": {"v": 1.0}, "c": {"v": 0.25}, "d": {}}
    result = beam(
        Scorer(TableEvaluator(table), RolloutBudget(100)),
        ScriptedProposer(["a", "b", "c", "d"]),
        BASE,
        TRAIN,
        VAL,
        SearchConfig(width=1, branch=2, rounds=2),
    )
    assert result.best.slots == {"sys": "b"}
    assert all(c.accepted_by.get("round") in (0, 1) for c in result.candidates[1:])
    # round 1 expands only the best of round 0
    assert {c.parents[0] for c in result.candidates if c.accepted_by.get("round") == 1} <= {candidate_id({"sys": "b"})}


def test_configuration_errors_say_what_to_set():
    with pytest.raises(ConfigurationError, match="unknown search"):
        get_search("apo")
    with pytest.raises(ConfigurationError, match="at least 12"):
        optimize(TableEvaluator(TABLE), ScriptedProposer([]), BASE, train=TRAIN, val=VAL, test=TEST, max_rollouts=11)
    with pytest.raises(ConfigurationError, match="no slots"):
        gepa(
            Scorer(TableEvaluator(TABLE), RolloutBudget(10)),
            ScriptedProposer([]),
            BASE,
            TRAIN,
            VAL,
            SearchConfig(slots=["user"]),
        )


class SlotEcho:
    """Proposes '<slot>-<n>' for each asked slot and records which slots each request asked for."""

    def __init__(self) -> None:
        self.asked: list[list[str]] = []

    def propose(self, request):
        self.asked.append(list(request.slots))
        return Proposal({s: f"{s}-{len(self.asked)}" for s in request.slots})


class Zero:
    def run(self, slots, task_ids):
        return [Episode(t, 0.0) for t in task_ids]


def test_round_robin_over_slots_or_all_at_once():
    base = {"a": "A", "b": "B", "c": "C"}
    echo = SlotEcho()
    gepa(Scorer(Zero(), RolloutBudget(40)), echo, base, TRAIN, VAL, SearchConfig(minibatch=2, slots=["a", "c"]))
    assert echo.asked[:4] == [["a"], ["c"], ["a"], ["c"]]  # only the chosen slots, in turn
    echo_all = SlotEcho()
    gepa(Scorer(Zero(), RolloutBudget(20)), echo_all, base, TRAIN, VAL, SearchConfig(minibatch=2, all_slots=True))
    assert echo_all.asked[0] == ["a", "b", "c"]


def test_the_end_to_end_task_reward_reads_french_replies():
    from bench.apo_agent import is_french

    # replies SmolLM2-135M-Instruct gave (greedy) with and without "Always reply in French."
    french = [
        "La femme de France est la femme de France.",
        "La lumière dans le ciel est un lieur de la lumière, c'",
        "Bees sont les amants, les amants de l'hippe. Les am",
    ]
    english = [
        "The capital of France is Paris.",
        "The opposite of hot is cold.",
        "The planet we live on is called Earth.",
        'The animal that says "moo" is a kangaroo.',
        "bees make a waxen body part called a stinger.",
    ]
    assert all(is_french(t) for t in french)
    assert not any(is_french(t) for t in english)
