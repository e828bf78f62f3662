"""Synchronous vs asynchronous training on the demo's task with stragglers, in one run, same seeds.

The demo (``fulmen demo``: the warmed-up tiny model, Kafka, ``fulmen consume``, both gateways, a runner, the
trainer in this process) twice, one after the other, with the demo's agent behind a heavy-tailed delay
(``bench/straggler_agent.py``: most rollouts wait ``--quick-s`` seconds, one in ten ten times as long):

* ``sync`` (``FULMEN_TRAIN_MODE=sync``, the default): a step dispatches and collects only while it waits for its
  groups; samples at most one version old;
* ``async`` (``FULMEN_TRAIN_MODE=async``, ``max_staleness`` ``--staleness``): dispatching and collecting never
  pause; samples up to that many versions old, weighed by truncated importance sampling (``tis``).

Measured from the start of training (services up, the warm-up cached): the wall-clock to each step, to the first
validation with held-out accuracy >= ``--mark`` (greedy, 48 held-out questions, every 5 steps and after the
last), the final held-out accuracy, how old the trained samples were (``staleness_histogram``: samples per
versions behind, over the run), and where each run waited (per step: rollouts, update, save+publish; and the
validations). ``speedup_to_accuracy`` = sync's time to the mark / async's (None when one never reached it).

    .venv/bin/python bench/async_vs_sync.py [--steps 30] [--quick-s 1.0] [--staleness 2] [--threads 1] [--only async]

``--threads 1`` gives the trainer and each service one torch thread: on 2 cores, the overlap async mode exists for
(an update while the gateway generates) otherwise runs 2 + 2 spinning OpenMP threads on 2 cores, and a torch step
with 2 threads on a loaded core pair was measured ~8x slower than with one (``bench/credit.py``'s warm-up).

Prints one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    from fulmen.algorithm.demo.run import DemoOptions, run_demo
    from fulmen.infra.settings import FulmenSettings

    settings = FulmenSettings(home=args.home)
    options = DemoOptions(
        steps=args.steps,
        mode=mode,
        max_staleness=args.staleness if mode == "async" else 1,
        agent="straggler_agent:solve",
        concurrency=args.concurrency,
        seed=args.seed,
    )
    clock: dict[str, float] = {}
    arrivals: list[tuple[int, float, dict[str, float]]] = []

    def on_phase(text: str) -> None:
        print(f"[{mode}] {text}", file=sys.stderr, flush=True)
        if text == "training":
            clock["start"] = time.perf_counter()

    def on_step(event: Any) -> None:
        at = time.perf_counter() - clock.get("start", time.perf_counter())
        arrivals.append((event.step, at, dict(event.extra)))
        accuracy = event.extra.get("val_accuracy")
        print(
            f"[{mode}] step {event.step} at {at:.1f}s reward {event.reward_mean:.3f}"
            + (f" held-out {accuracy:.3f}" if accuracy is not None else ""),
            file=sys.stderr,
            flush=True,
        )

    run = run_demo(settings, options, on_phase=on_phase, on_step=on_step)
    return summarise(mode, run, arrivals, args.mark)


def summarise(mode: str, run: Any, arrivals: list[tuple[int, float, dict[str, float]]], mark: float) -> dict:
    steps = run.steps
    initial = steps[0].extra.get("initial_val_accuracy") if steps else None
    curve = [(step, round(at, 1), extra["val_accuracy"]) for step, at, extra in arrivals if "val_accuracy" in extra]
    reached = next(((step, at) for step, at, accuracy in curve if accuracy >= mark), None)
    histogram: dict[str, int] = {}
    for _, _, extra in arrivals:
        for key, value in extra.items():
            if key.startswith("staleness_") and key.split("_")[1].isdigit():
                histogram[key.split("_")[1]] = histogram.get(key.split("_")[1], 0) + int(value)
    n = max(len(steps), 1)
    return {
        "mode": mode,
        "steps": len(steps),
        "wall_to_last_step_s": arrivals[-1][1] if arrivals else None,
        "steps_per_minute": round(60 * len(arrivals) / arrivals[-1][1], 2) if arrivals else None,
        "accuracy_before": initial,
        "accuracy_curve": curve,
        "final_accuracy": curve[-1][2] if curve else None,
        "step_to_mark": reached[0] if reached else None,
        "s_to_mark": reached[1] if reached else None,
        "staleness_histogram": dict(sorted(histogram.items(), key=lambda kv: int(kv[0]))),
        "dropped_stale": sum(s.dropped_stale for s in steps),
        "profile_per_step_s": {
            "rollout_wait": round(sum(s.rollout_wait_s for s in steps) / n, 2),
            "update": round(sum(s.train_s for s in steps) / n, 2),
            "save_and_publish": round(sum(s.publish_s for s in steps) / n, 2),
        },
        "is_truncated_fraction_mean": round(sum(s.extra.get("is_truncated_fraction", 0.0) for s in steps) / n, 4),
        "reward_curve": [(s.step, round(s.reward_mean, 3)) for s in steps],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quick-s", type=float, default=1.0)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--mark", type=float, default=0.9)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=("sync", "async"), action="append")
    parser.add_argument("--home", type=Path, default=Path.home() / ".cache" / "fulmen" / "bench-async")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads of the trainer and of each service "
        "(OMP_NUM_THREADS); 0: torch's default (all cores, in every process)",
    )
    args = parser.parse_args()
    os.environ["STRAGGLER_QUICK_S"] = str(args.quick_s)
    if args.threads:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the services inherit it
        torch.set_num_threads(args.threads)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "bench"), os.environ.get("PYTHONPATH")]))
    results = {mode: run_mode(mode, args) for mode in args.only or ("sync", "async")}
    sync, asyn = results.get("sync"), results.get("async")
    out: dict[str, Any] = {**results}
    if sync and asyn:
        out["speedup_to_accuracy"] = (
            round(sync["s_to_mark"] / asyn["s_to_mark"], 2) if sync["s_to_mark"] and asyn["s_to_mark"] else None
        )
        out["speedup_to_step"] = round(sync["wall_to_last_step_s"] / asyn["wall_to_last_step_s"], 2)
        out["final_accuracy_sync"], out["final_accuracy_async"] = sync["final_accuracy"], asyn["final_accuracy"]
        out["staleness_histogram"] = asyn["staleness_histogram"]
    out["settings"] = {
        "steps": args.steps,
        "quick_s": args.quick_s,
        "slow": "1 in 10, 10x",
        "mark": args.mark,
        "async_max_staleness": args.staleness,
        "threads": args.threads or "default",
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
