"""``fulmen demo`` with each algorithm (and mode): does the demo's agent learn with it?

Runs the real command once per ``--algorithm`` (``fulmen demo --algorithm X --mode Y --steps N --json``: the
warmed-up tiny model, Kafka, ``fulmen consume``, both gateways, a runner, the trainer; the warm-up cached in
``--home``), one after the other, and reports held-out accuracy before and after (greedy, 48 held-out
questions, through the system) and whether it went from at most 45% to at least 70% (the issue's bar).

    .venv/bin/python bench/demo_algorithms.py [--algorithms dapo gspo cispo] [--mode sync] [--steps 25]

Prints one JSON object on its last line keyed by algorithm.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

FULMEN = [sys.executable, "-m", "fulmen.cli.main"]


def run(algorithm: str, mode: str, steps: int, home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {"FULMEN_HOME": str(home)}
    started = time.perf_counter()
    done = subprocess.run(
        [*FULMEN, "demo", "--algorithm", algorithm, "--mode", mode, "--steps", str(steps), "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    print(done.stdout[-1500:], file=sys.stderr, flush=True)
    if done.returncode != 0:
        return {"error": done.stderr[-1500:], "wall_s": round(time.perf_counter() - started)}
    report = json.loads(done.stdout.strip().splitlines()[-1])
    before, after = report["accuracy_before"], report["accuracy_after"]
    return {
        "mode": mode,
        "steps": report["steps"],
        "accuracy_before": before,
        "accuracy_after": after,
        "learns": before is not None and after is not None and before <= 0.45 and after >= 0.70,
        "accuracy_curve": report["accuracy_curve"],
        "reward_curve": report["reward_curve"],
        "mean_update_s": report["mean_update_s"],
        "train_s": report["train_s"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", nargs="+", default=["dapo", "gspo", "cispo"])
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--home", type=Path, default=Path.home() / ".cache" / "fulmen" / "bench-async")
    args = parser.parse_args()
    results = {name: run(name, args.mode, args.steps, args.home) for name in args.algorithms}
    results["settings"] = {"steps": args.steps, "mode": args.mode, "loadavg": os.getloadavg()}
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
