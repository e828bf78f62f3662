"""Does a real model learn through the whole system? SmolLM2-135M-Instruct on the three examples, on the CPU, with
a protocol a skeptic can check: a large held-out set, a paired confidence interval, a shuffled-reward control.

Per scenario, two runs of ``python -m examples.train NAME --model smollm2`` (the driver a user runs: Kafka, the
store, both gateways, a runner with the real framework, the trainer; everything stopped after), each in its own
process, one after the other:

1. the real run: a cached supervised warm-up on the teacher's demonstrations of ``--warmup-tasks`` training tasks
   (``examples.teacher``; "before" means after it), then ``--steps`` GRPO steps on training tasks;
2. the control: the same seeds and settings with the rewards of each step shuffled across its rollouts
   (``--shuffle-rewards``), which keeps everything but the signal.

Held-out: ``--heldout`` problems (200 by default) of the example's held-out split (never in training or warm-up:
``examples/*/data.py`` draws them from other seeds and drops any question the training split holds), run greedily
through the whole system before the first step, every ``--val-every`` steps and after the last. ``heldout_ci95`` is
the 95% interval of the paired difference after minus before (the same tasks; normal approximation of the mean of
per-task differences). ``tool_call_valid_*``: the share of held-out episodes whose first call was a well-formed
tool call (the gateway parsed one).

Where a step goes (``profile``): ``gen_s_per_step`` (waiting for the step's rollouts: generation, the agents,
Kafka and the store), ``update_s_per_step``, ``publish_s_per_step`` (checkpoint, version published and loaded),
the validations' seconds, tokens per episode and seconds inside LLM calls vs the whole episode (from the spans).
``update_gflops``: the update's matrix-multiply FLOPs (``StepMetrics.flops``) per second, against a 2048^3 float32
matmul measured in the same run (``matmul_gflops``). ``tokens_trained_per_step``: tokens the decoder computed in
one training pass (shared prefixes once), beside ``input_tokens_per_step`` (the batch's tokens, row by row).

    .venv/bin/python bench/scenarios.py --only calc_agent [--steps 40] [--no-control] [--engine llamacpp]
    .venv/bin/python bench/scenarios.py --only calc_agent --control-only --real-from real.out   # the control later

Prints one JSON object on its last line keyed by scenario (``calc_agent``, ...) with the keys of issue 27
(``heldout_before``, ``heldout_after``, ``heldout_ci95``, ``heldout_n``, ``control_delta``, ``s_per_step``,
``gen_s_per_step``, ``update_s_per_step``, ``update_gflops``, ``tokens_trained_per_step``, ``steps``, ``wall_s``,
``tool_call_valid_before``, ``tool_call_valid_after``, ``model``, ``engine``), the control's figures under
``control``, and writes the held-out curves (real run and control, with the intervals) to ``--plot``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("sql_agent", "rag_agent", "calc_agent")
MODEL = "SmolLM2-135M-Instruct (CPU, float32)"
Z95 = 1.959964


def run_example(name: str, args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    """One ``examples.train`` run in its own process; its JSON report (or the error)."""
    settings = (("steps", args.steps), ("group-size", args.group_size), ("groups-per-step", args.groups_per_step),
                ("heldout", args.heldout), ("train", args.train), ("lr", args.lr), ("kl-coef", args.kl_coef),
                ("epochs-per-batch", args.epochs), ("warmup-steps", args.warmup_steps),
                ("warmup-tasks", args.warmup_tasks), ("warmup-lr", args.warmup_lr), ("concurrency", args.concurrency),
                ("rollout-timeout-s", args.rollout_timeout_s), ("val-every", args.val_every),
                ("lora-r", args.lora_r), ("micro-batch-tokens", args.micro_batch_tokens), ("engine", args.engine),
                ("llm-context", args.llm_context),
                ("seed", args.seed))  # fmt: skip
    command = [sys.executable, "-m", "examples.train", name, "--model", "smollm2", "--json"]
    for flag, value in settings:
        command += [f"--{flag}", str(value)]
    if args.max_tokens:
        command += ["--max-tokens", str(args.max_tokens)]
    command += list(extra)
    print("$ " + " ".join(command[1:]), file=sys.stderr, flush=True)
    started = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {"FULMEN_HOME": str(args.home)}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False, env=env)
    print(done.stdout[-4000:], file=sys.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        wall = round(time.perf_counter() - started)
        return {"error": f"exit {done.returncode}: {done.stderr[-2000:]}", "wall_s": wall}
    return json.loads(lines[-1]) | {"process_wall_s": round(time.perf_counter() - started, 1)}


def paired(report: dict[str, Any]) -> dict[str, Any]:
    """Held-out accuracy at the first and the last version validated, and the 95% interval of the paired
    difference (tasks validated at both)."""
    by_version = report.get("heldout_by_version") or {}
    if len(by_version) < 2:
        return {}
    versions = sorted(by_version, key=int)
    before, after = by_version[versions[0]], by_version[versions[-1]]
    tasks = sorted(set(before) & set(after))
    if not tasks:
        return {}
    correct = [(float(before[t] > 0.5), float(after[t] > 0.5)) for t in tasks]
    diffs = [a - b for b, a in correct]
    n = len(diffs)
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else 0.0
    half = Z95 * sd / math.sqrt(n)
    return {
        "heldout_before": round(sum(b for b, _ in correct) / n, 4),
        "heldout_after": round(sum(a for _, a in correct) / n, 4), "heldout_delta": round(mean, 4),
        "heldout_ci95": [round(mean - half, 4), round(mean + half, 4)], "heldout_n": n,
        "heldout_versions": [int(versions[0]), int(versions[-1])],
    }  # fmt: skip


def tool_calls(report: dict[str, Any]) -> dict[str, float | None]:
    validity = report.get("tool_call_valid_by_version") or {}
    if not validity:
        return {"tool_call_valid_before": None, "tool_call_valid_after": None}
    versions = sorted(validity, key=int)
    return {"tool_call_valid_before": round(validity[versions[0]]["rate"], 4),
            "tool_call_valid_after": round(validity[versions[-1]]["rate"], 4)}  # fmt: skip


def figures(report: dict[str, Any], matmul_gflops: float) -> dict[str, Any]:
    """The issue's keys for one run."""
    if "error" in report:
        return report
    steps = report.get("step_profile") or {}
    gen, update, publish = steps.get("rollout_wait_s"), steps.get("update_s"), steps.get("publish_s")
    flops = steps.get("update_flops")
    gflops = round(flops / update / 1e9, 2) if flops and update else None
    return {
        **paired(report), **tool_calls(report),
        "s_per_step": round(sum(x for x in (gen, update, publish) if x is not None), 2) if gen is not None else None,
        "gen_s_per_step": gen, "update_s_per_step": update, "publish_s_per_step": publish, "update_gflops": gflops,
        "update_gflops_of_matmul": round(gflops / matmul_gflops, 3) if gflops else None,
        "tokens_trained_per_step": steps.get("computed_tokens"), "input_tokens_per_step": steps.get("input_tokens"),
        "response_tokens_per_step": steps.get("response_tokens"), "steps": report.get("steps"),
        "wall_s": report.get("wall_s"), "model": MODEL, "engine": report.get("engine"),
        "heldout_curve": report.get("heldout_curve"), "reward_curve": report.get("reward_curve"),
        "profile": {"step": steps, "episode": report.get("episode_profile")},
        "calls_per_episode": report.get("calls_per_episode"), "run_dir": report.get("run_dir"),
    }  # fmt: skip


def last_json(path: Path, names: list[str]) -> dict[str, Any]:
    """The last JSON line of an earlier run's output, which must hold the real run of each of ``names``."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.startswith("{")]
        earlier = json.loads(lines[-1]) if lines else None
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"--real-from {path}: {exc}") from exc
    if not isinstance(earlier, dict):
        raise SystemExit(f"--real-from {path}: no JSON line (give the output of an earlier run of this bench)")
    missing = [n for n in names if "heldout_curve" not in (earlier.get(n) or {})]
    if missing:
        raise SystemExit(f"--real-from {path}: no real run of {', '.join(missing)} in it")
    return earlier


def matmul_rate(size: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of a float32 ``size``^3 matmul on this machine, now (the best of ``repeats``)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return round(2 * size**3 / best / 1e9, 1)


def plot(results: dict[str, Any], path: Path) -> None:
    """Held-out accuracy by step, real run and control, per scenario (the final point with its interval)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in SCENARIOS if isinstance(results.get(n), dict) and results[n].get("heldout_curve")]
    if not names:
        return
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        control = results[name].get("control") or {}
        for label, run, style in (("GRPO", results[name], "-o"), ("shuffled rewards (control)", control, "--s")):
            curve = run.get("heldout_curve") or []
            if curve:
                ax.plot([s for s, _ in curve], [100 * a for _, a in curve], style, label=label)
        ci = results[name].get("heldout_ci95")
        if ci and results[name].get("heldout_curve"):
            last_step = results[name]["heldout_curve"][-1][0]
            before = results[name]["heldout_before"]
            ax.errorbar([last_step], [100 * (before + (ci[0] + ci[1]) / 2)], yerr=[[100 * (ci[1] - ci[0]) / 2]],
                        fmt="none", capsize=4, color="black", label="95% interval of the gain")  # fmt: skip
        ax.set_title(f"{name}: held-out accuracy (n={results[name].get('heldout_n')})")
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("% correct (greedy, through the system)")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=SCENARIOS, action="append", help="run only these (repeatable)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--train", type=int, default=2000, help="training tasks (each step takes the next groups)")
    parser.add_argument("--heldout", type=int, default=200)
    parser.add_argument("--val-every", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=0, help="per LLM call; 0: the agent's default")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--kl-coef", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=1, help="PPO passes over each step's batch")
    parser.add_argument("--lora-r", type=int, default=0, help="LoRA rank (0: every weight trains)")
    parser.add_argument("--micro-batch-tokens", type=int, default=2048, help="prefix-tree micro-batches")
    parser.add_argument("--warmup-steps", type=int, default=8)
    parser.add_argument("--warmup-tasks", type=int, default=32)
    parser.add_argument("--warmup-lr", type=float, default=1e-4)
    parser.add_argument("--concurrency", type=int, default=32, help="rollouts a runner runs at once (a step's "
                        "episodes in one wave)")  # fmt: skip
    parser.add_argument("--llm-context", type=int, default=2048, help="llamacpp: KV tokens per slot")
    parser.add_argument("--rollout-timeout-s", type=float, default=900.0)
    parser.add_argument("--engine", default="llamacpp", help="the LLM gateway's backend (transformers, llamacpp)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-control", action="store_true")
    parser.add_argument("--control-only", action="store_true")
    parser.add_argument("--real-from", type=Path, help="with --control-only: the real run's figures from an earlier "
                        "run of this bench (its output), so the report and the plot hold both")  # fmt: skip
    parser.add_argument("--home", type=Path, default=Path.home() / ".cache" / "fulmen" / "bench-scenarios")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "scenarios_heldout.png")
    args = parser.parse_args()
    if args.real_from and not args.control_only:
        parser.error("--real-from goes with --control-only")
    earlier = last_json(args.real_from, args.only or list(SCENARIOS)) if args.real_from else {}
    started = time.perf_counter()
    matmul = matmul_rate()
    print(f"float32 2048^3 matmul: {matmul} GFLOP/s", file=sys.stderr, flush=True)
    results: dict[str, Any] = {}
    for name in args.only or SCENARIOS:
        result: dict[str, Any] = {k: v for k, v in (earlier.get(name) or {}).items() if k != "control"}
        if not args.control_only:
            print(f"--- {name}", file=sys.stderr, flush=True)
            result = figures(run_example(name, args), matmul)
        if not args.no_control:
            print(f"--- {name} with shuffled rewards (control)", file=sys.stderr, flush=True)
            control = figures(run_example(name, args, "--shuffle-rewards"), matmul)
            result["control"] = control
            result["control_delta"] = control.get("heldout_delta")
            result["control_ci95"] = control.get("heldout_ci95")
        results[name] = result
    plot(results, args.plot)
    results["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()} | {
        "matmul_gflops": matmul, "wall_s": round(time.perf_counter() - started, 1), "loadavg": os.getloadavg(),
        "peak_rss_mb_bench": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }  # fmt: skip
    for name in args.only or SCENARIOS:
        results[name].setdefault("matmul_gflops", matmul)
    if earlier:
        results["settings"]["real_from"] = earlier.get("settings")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
