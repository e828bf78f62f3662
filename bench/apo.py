"""Prompt search (issue 29): GEPA against beam over the real optimiser URL path, with a simulated evaluator.

What this measures today: the two searches (``fulmen.algorithm.prompts``) driving the reflective proposer over
HTTP against the scripted optimiser (``fulmen.optimizer_testing``: five distractors, then the good instruction),
scored by a table evaluator (a seeded table of rewards per instruction and task: the base prompt and the
distractors succeed on some tasks, the good instruction on nearly all). Each search runs under one
``--max-rollouts`` budget, with the test split scored after the search.

Not measured yet (printed as null): the keys that need the evaluator through the whole system (bundles published
and served by the LLM gateway, rollouts dispatched through Kafka and runners): ``bundle_mismatches`` and
``publish_to_serve_p95_s``; ``heldout_before``/``heldout_after`` here are the table evaluator's, not a model's.

    .venv/bin/python bench/apo.py [--max-rollouts 200] [--seed 0]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random

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
        return [Episode(t, row.get(t, 0.0), f"{t}", f"task {t}: the answer was not in the required form")
                for t in task_ids]  # fmt: skip


def run_search(search: str, max_rollouts: int, seed: int):
    with scripted_optimizer([*DISTRACTORS, GOOD]) as server:
        proposer = ReflectiveProposer(server.url(), model="scripted")
        config = SearchConfig(seed=seed, minibatch=3, width=2, branch=2, rounds=4)
        return optimize(TableEvaluator(1234), proposer, BASE, train=TRAIN, val=VAL, test=TEST,
                        max_rollouts=max_rollouts, search=search, config=config)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-rollouts", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    gepa_runs = [run_search("gepa", args.max_rollouts, args.seed) for _ in range(3)]
    beam = run_search("beam", args.max_rollouts, args.seed)
    gepa = gepa_runs[0]
    for name, result in (("gepa", gepa), ("beam", beam)):
        print(f"{name}: best {result.best.slots['system']!r} at {result.rollouts_to_best} rollouts; {result.report}")
    print(json.dumps({
        "evaluator": "table (simulated); the system evaluator is not built yet",
        "heldout_before": gepa.report["heldout_before"],
        "heldout_after": gepa.report["heldout_after"],
        "rollouts_used": max(r.rollouts_used for r in [*gepa_runs, beam]),
        "max_rollouts": args.max_rollouts,
        "gepa_rollouts_to_best": gepa.rollouts_to_best,
        "beam_rollouts_to_best": beam.rollouts_to_best,
        "beam_heldout_after": beam.report["heldout_after"],
        "lineage_identical_across_seeds": all(r.lineage() == gepa.lineage() for r in gepa_runs),
        "bundle_mismatches": None,
        "publish_to_serve_p95_s": None,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
