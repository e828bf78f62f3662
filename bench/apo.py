"""Prompt search (issue 29): GEPA against beam (simulated evaluator), and GEPA end to end through the system.

Simulated part: the two searches (``fulmen.algorithm.prompts``) drive the reflective proposer over HTTP against the
scripted optimiser (``fulmen.optimizer_testing``: five distractors, then the good instruction), scored by a table
evaluator (a seeded table of rewards per instruction and task: the base prompt and the distractors succeed on some
tasks, the good instruction on nearly all), each under one ``--max-rollouts`` budget with the test split scored
after the search: ``gepa_rollouts_to_best``, ``beam_rollouts_to_best``, ``lineage_identical_across_seeds`` (3 GEPA
runs, one seed), ``simulated_heldout_*``.

End-to-end part (bench/apo_system.py, skipped with ``--no-system``): ``fulmen.optimize_prompt`` on a local stack
serving SmolLM2-135M-Instruct behind the LLM gateway, on bench/apo_agent.py's French task, the same scripted
optimiser: ``heldout_before``/``heldout_after`` (test split), ``rollouts_used`` (of ``--system-max-rollouts``),
``bundle_mismatches`` (SQL on the store) and ``publish_to_serve_p95_s`` (``--reps`` promotions, each timed from its
publication to the first gateway call served with it).

    .venv/bin/python bench/apo.py [--max-rollouts 200] [--seed 0] [--system-max-rollouts 100] [--reps 10]

Run from the repository root. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.* (and the runner imports bench.apo_agent)

from fulmen.algorithm.prompts import Episode, SearchConfig, optimize
from fulmen.algorithm.prompts.reflect import ReflectiveProposer
from fulmen.optimizer_testing import scripted_optimizer

BASE = {"system": "You are a helpful assistant."}
GOOD = "Always reply in French."
DISTRACTORS = ["Be concise.", "Think step by step.", "Be polite.", "Answer with one word in UPPERCASE.", "Be exact."]
TRAIN = [f"train-{i}" for i in range(16)]
VAL = [f"val-{i}" for i in range(12)]
TEST = [f"test-{i}" for i in range(12)]


class TableEvaluator:
    """Reward 1 or 0 per (instruction, task) from a seeded table: the base prompt and every distractor succeed on the
    same 10% of tasks, the good instruction on 95%. That is what SmolLM2-135M-Instruct did when probed (greedy,
    6 questions): "Always reply in French." was followed 6/6; the base prompt and the instructions it ignores
    ("Answer with one word in UPPERCASE.", "Start your reply with 'ANSWER:'.") gave 0/6 French replies alike."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        tasks = TRAIN + VAL + TEST
        base = {t: float(rng.random() < 0.1) for t in tasks}
        self.table = {BASE["system"]: base, **{d: base for d in DISTRACTORS}}
        self.table[GOOD] = {t: float(rng.random() < 0.95) for t in tasks}

    def run(self, slots, task_ids):
        row = self.table.get(slots["system"], {})
        return [
            Episode(t, row.get(t, 0.0), f"{t}", f"task {t}: the answer was not in the required form") for t in task_ids
        ]


def run_search(search: str, max_rollouts: int, seed: int):
    with scripted_optimizer([*DISTRACTORS, GOOD]) as server:
        proposer = ReflectiveProposer(server.url(), model="scripted")
        config = SearchConfig(seed=seed, minibatch=3, width=2, branch=2, rounds=4)
        return optimize(
            TableEvaluator(1234),
            proposer,
            BASE,
            train=TRAIN,
            val=VAL,
            test=TEST,
            max_rollouts=max_rollouts,
            search=search,
            config=config,
        )


def simulated(max_rollouts: int, seed: int) -> dict:
    gepa_runs = [run_search("gepa", max_rollouts, seed) for _ in range(3)]
    beam = run_search("beam", max_rollouts, seed)
    gepa = gepa_runs[0]
    for name, result in (("gepa", gepa), ("beam", beam)):
        print(f"{name}: best {result.best.slots['system']!r} at {result.rollouts_to_best} rollouts; {result.report}")
    return {
        "evaluator": "table (simulated) for the gepa/beam comparison; the system (SmolLM2 behind the gateway) for "
        "heldout_*, rollouts_used, bundle_mismatches, publish_to_serve_*",
        "simulated_heldout_before": gepa.report["heldout_before"],
        "simulated_heldout_after": gepa.report["heldout_after"],
        "simulated_rollouts_used": max(r.rollouts_used for r in [*gepa_runs, beam]),
        "max_rollouts": max_rollouts,
        "gepa_rollouts_to_best": gepa.rollouts_to_best,
        "beam_rollouts_to_best": beam.rollouts_to_best,
        "beam_heldout_after": beam.report["heldout_after"],
        "lineage_identical_across_seeds": all(r.lineage() == gepa.lineage() for r in gepa_runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-rollouts", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--system",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run GEPA end to end through the system with SmolLM2 (minutes)",
    )
    parser.add_argument("--system-max-rollouts", type=int, default=100)
    parser.add_argument("--reps", type=int, default=10, help="promotions timed for publish_to_serve")
    args = parser.parse_args()
    keys = simulated(args.max_rollouts, args.seed)
    nulls = dict.fromkeys(
        ("heldout_before", "heldout_after", "rollouts_used", "bundle_mismatches", "publish_to_serve_p95_s")
    )
    if args.system:
        from bench.apo_system import run_system

        nulls = run_system(args.system_max_rollouts, args.seed, args.reps, [*DISTRACTORS, GOOD])
    print(json.dumps(keys | nulls))


if __name__ == "__main__":
    main()
