"""How far does a seed make a run reproducible? Two runs of one seed through the whole system, compared rollout by
rollout.

Each run is ``python -m examples.train calc_agent --model smollm2 --engine llamacpp`` with the scenarios bench's
warm-up (cached: the same recipe as ``bench/scenarios.py``'s seed 0) and ``--steps`` GRPO steps, the same
``--seed`` both times. Every training rollout carries a seed from (run seed, group, member) and each of its LLM
calls one from (rollout seed, attempt, call number) (``fulmen.infra.seeds``), so a rollout is recognised across
the runs by its first call's seed. Read back from each run's store (the gateway's spans), compared:

* ``identical_rollouts_share``: rollouts whose every call sampled the same response tokens;
* ``identical_first_calls_share``: the first call alone (the same prompt in both runs, so only the engine can differ:
  llama.cpp batches concurrent requests, and a different batch can change the float sums behind a logit);
* ``same_reward_share``: rollouts with the same reward; and the step's mean reward in each run.

Only rollouts served by model version 0 are compared (after the first update the two runs' models may differ,
by the same float sums). ``--compare RUN_DIR [RUN_DIR]`` compares with runs already made instead (say the scenarios
bench's seed-0 run and its control, which share seed 0 up to their first update); with one, a fresh run of the
same seed is the other (its settings must be the bench's: they are, apart from ``--steps`` and ``--heldout``,
which change nothing before the first update).

    .venv/bin/python bench/reproducible.py [--steps 1] [--seed 0]
    .venv/bin/python bench/reproducible.py --compare ~/.cache/fulmen/bench-scenarios/runs/{RUN_A,RUN_B}

Prints one JSON object on its last line; writes it to ``bench/results/reproducible.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "reproducible.json"
SEED_ATTRIBUTE = "gen_ai.request.seed"


def one_run(args: argparse.Namespace) -> dict[str, Any]:
    """One ``examples.train`` run; its JSON report."""
    command = [
        sys.executable,
        "-m",
        "examples.train",
        "calc_agent",
        "--model",
        "smollm2",
        "--engine",
        "llamacpp",
        "--json",
        "--seed",
        str(args.seed),
        "--steps",
        str(args.steps),
        "--heldout",
        str(args.heldout),
        "--warmup-steps",
        "8",
        "--warmup-tasks",
        "32",
        "--warmup-lr",
        "1e-4",
        "--train",
        "2000",
        "--group-size",
        "8",
        "--groups-per-step",
        "4",
        "--concurrency",
        "32",
        "--llm-context",
        "1024",
        "--micro-batch-tokens",
        "2048",
        "--rollout-timeout-s",
        "900",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {"FULMEN_HOME": str(args.home)}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"examples.train failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1])


def dump(store: Path) -> dict[str, Any]:
    """Training rollouts of the store at ``store``: the first call's seed -> (reward, each call's response ids).
    Runs in its own process (chdb opens one store directory per process)."""
    import clickhouse_connect

    client = clickhouse_connect.get_client(dsn=f"chdb://{store}")
    rows = client.query(
        "SELECT t.RolloutId, arrayMap(x -> x.2, arraySort(groupArray((t.Timestamp, t.SpanAttributes[%(seed)s])))), "
        "arrayMap(x -> x.2, arraySort(groupArray((t.Timestamp, t.ResponseTokenIds)))), any(r.Reward) "
        "FROM fulmen.otel_traces AS t INNER JOIN (SELECT RolloutId, argMax(Reward, StatusRank) AS Reward "
        "FROM fulmen.rollouts WHERE Mode = 'train' GROUP BY RolloutId) AS r ON r.RolloutId = t.RolloutId "
        "WHERE t.ServiceName = 'fulmen-llm-gateway' AND t.ModelVersion = 0 GROUP BY t.RolloutId",
        parameters={"seed": SEED_ATTRIBUTE},
    ).result_rows
    return {
        seeds[0]: {"reward": reward, "calls": [list(ids) for ids in responses]}
        for _, seeds, responses, reward in rows
        if seeds and seeds[0]
    }


def read_store(store: Path) -> dict[str, Any]:
    done = subprocess.run([sys.executable, __file__, "--dump", str(store)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"could not read {store}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def compare(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    both = sorted(set(first) & set(second))
    if not both:
        return {"rollouts_compared": 0}

    def share(test: Any) -> float:
        return round(sum(1 for key in both if test(first[key], second[key])) / len(both), 4)

    return {
        "rollouts_compared": len(both),
        "rollouts_only_in_one": len(set(first) ^ set(second)),
        "identical_rollouts_share": share(lambda a, b: a["calls"] == b["calls"]),
        "identical_first_calls_share": share(lambda a, b: a["calls"][:1] == b["calls"][:1]),
        "same_reward_share": share(lambda a, b: a["reward"] == b["reward"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout", type=int, default=8, help="held-out problems validated (kept small)")
    parser.add_argument("--home", type=Path, default=Path.home() / ".cache" / "fulmen" / "bench-scenarios")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--compare", type=Path, nargs="+", metavar="RUN_DIR", help="one or two runs already made")
    parser.add_argument("--dump", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dump:
        print(json.dumps(dump(args.dump)))
        return 0
    started = time.perf_counter()
    if args.compare and len(args.compare) > 2:
        parser.error("--compare takes one or two run directories")
    made = [{"run_dir": str(d)} for d in args.compare or []]
    reports = made + [one_run(args) for _ in range(2 - len(made))]
    stores = [read_store(Path(report["run_dir"]) / "chdb") for report in reports]
    result = compare(*stores) | {
        "runs": [report["run_dir"] for report in reports],
        "engine": "llamacpp",
        "model": "SmolLM2-135M-Instruct",
        "seed": args.seed,
        "steps": None if len(made) == 2 else args.steps,
        "reward_by_run": [report.get("reward_curve") for report in reports],
        "wall_s": round(time.perf_counter() - started, 1),
        "finished": time.strftime("%Y-%m-%d %H:%M"),
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
