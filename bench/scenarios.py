"""Does a real model learn through the whole system? SmolLM2-135M-Instruct on the three examples, on the CPU, with
a protocol a skeptic can check: several seeds, two held-out splits (in distribution, and shapes never trained on),
an equal-compute SFT baseline, the model with no warm-up, and a shuffled-reward control.

Each part is one ``python -m examples.train NAME --model smollm2`` run in its own process (the driver a user runs:
Kafka, the store, both gateways, a runner with the real framework, the trainer; everything stopped after):

* ``real`` (one per seed, ``--seeds``): a cached supervised warm-up on the teacher's demonstrations of
  ``--warmup-tasks`` training tasks (seeded: its sampling order), then ``--steps`` GRPO steps on training tasks (a
  seeded task order; every rollout and LLM call seeded: ``fulmen.infra.seeds``);
* ``replay`` (one per seed, after that seed's ``real``): a fresh copy of the same warmed-up model trained by replay
  only (``--replay-store``: no rollouts of its own) on the training rollouts the real run stored, for as many steps;
  ``replay_fraction`` is its held-out gain over the real run's (issue 44), with a paired bootstrap interval; it needs
  the real run's store on this disk (``<run dir>/chdb``);
* ``control`` (seed 0): the same with the rewards of each step shuffled across its rollouts;
* ``sft`` (seed 0): the warmed-up model fine-tuned further on the teacher's demonstrations of ``--sft-tasks`` other
  training tasks, for as many tokens as the real runs trained on (their mean ``tokens_trained_per_step`` x steps),
  then validated (``--steps 0``);
* ``zero_shot``: the model with no warm-up, validated.

Validation (greedy, through the whole system) covers ``--heldout`` problems of the example's held-out split and
``--unseen`` of its unseen-shapes split, before the first step and after the last (``--val-every`` adds points).
Per-task outcomes come back from the run's store with SQL (``examples.outcomes``): solved or not, and the failure
kind. The arithmetic (pooled intervals, breakdowns) is ``bench/scenario_stats.py``.

Parts are resumable: each finished part is merged into ``--results`` (``bench/results/scenarios.json``) as it
ends, and a part already there is skipped unless ``--rerun``; ``--arms`` and ``--seeds`` choose what runs now.

    .venv/bin/python bench/scenarios.py --only calc_agent --arms real --seeds 1        # seed 0 only
    .venv/bin/python bench/scenarios.py --only calc_agent                              # the rest of the protocol
    .venv/bin/python bench/scenarios.py --only calc_agent --report-only                # the summary from the file
    .venv/bin/python bench/scenarios.py --only rag_agent --reclassify                  # failure kinds, from kept stores

Prints one JSON object on its last line keyed by scenario with the issue's keys (``seeds``, ``heldout_before``,
``heldout_after``, ``gain_by_seed``, ``heldout_ci95``, ``heldout_n``, ``unseen_before``, ``unseen_after``,
``unseen_ci95``, ``unseen_n``, ``sft_baseline_after``, ``zero_shot``, ``control_delta`` (and
``control_unseen_delta``), ``by_template``,
``failures_before``, ``failures_after``, ``wall_s``, ``s_per_step``, ``engine``, ``model``) and ``results``, the
path of the JSON file; the figure (every seed, the control, the baselines) goes to ``--plot``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the examples, read again by --reclassify
from scenario_stats import (
    accuracy,
    before_after,
    by_template,
    failure_counts,
    pooled_gain,
    ratio_interval,
    seed_interval,
)

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("sql_agent", "rag_agent", "calc_agent")
ARMS = ("real", "replay", "control", "sft", "zero_shot")
MODEL = "SmolLM2-135M-Instruct (CPU, float32)"
RESULTS = ROOT / "bench" / "results" / "scenarios.json"
PLOT = ROOT / "docs" / "scenarios_heldout.png"


def run_example(name: str, args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    """One ``examples.train`` run in its own process; its JSON report (or the error)."""
    settings = (
        ("steps", args.steps),
        ("group-size", args.group_size),
        ("groups-per-step", args.groups_per_step),
        ("heldout", args.heldout),
        ("train", args.train),
        ("lr", args.lr),
        ("kl-coef", args.kl_coef),
        ("epochs-per-batch", args.epochs),
        ("warmup-steps", args.warmup_steps),
        ("warmup-tasks", args.warmup_tasks),
        ("warmup-lr", args.warmup_lr),
        ("concurrency", args.concurrency),
        ("rollout-timeout-s", args.rollout_timeout_s),
        ("val-every", args.val_every),
        ("lora-r", args.lora_r),
        ("micro-batch-tokens", args.micro_batch_tokens),
        ("engine", args.engine),
        ("llm-context", args.llm_context),
        ("unseen", args.unseen),
        ("sft-tasks", args.sft_tasks),
    )
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


def tool_calls(report: dict[str, Any]) -> dict[str, float | None]:
    validity = report.get("tool_call_valid_by_version") or {}
    if not validity:
        return {"tool_call_valid_before": None, "tool_call_valid_after": None}
    versions = sorted(validity, key=int)
    return {
        "tool_call_valid_before": round(validity[versions[0]]["rate"], 4),
        "tool_call_valid_after": round(validity[versions[-1]]["rate"], 4),
    }


def figures(report: dict[str, Any], matmul_gflops: float) -> dict[str, Any]:
    """The issue's keys for one run."""
    if "error" in report:
        return report
    steps = report.get("step_profile") or {}
    gen, update, publish = steps.get("rollout_wait_s"), steps.get("update_s"), steps.get("publish_s")
    flops = steps.get("update_flops")
    gflops = round(flops / update / 1e9, 2) if flops and update else None
    return {
        **tool_calls(report),
        "s_per_step": round(sum(x for x in (gen, update, publish) if x is not None), 2) if gen is not None else None,
        "gen_s_per_step": gen,
        "update_s_per_step": update,
        "publish_s_per_step": publish,
        "update_gflops": gflops,
        "update_gflops_of_matmul": round(gflops / matmul_gflops, 3) if gflops else None,
        "tokens_trained_per_step": steps.get("computed_tokens"),
        "input_tokens_per_step": steps.get("input_tokens"),
        "response_tokens_per_step": steps.get("response_tokens"),
        "steps": report.get("steps"),
        "wall_s": report.get("wall_s"),
        "process_wall_s": report.get("process_wall_s"),
        "model": MODEL,
        "engine": report.get("engine"),
        "reward_curve": report.get("reward_curve"),
        "profile": {"step": steps, "episode": report.get("episode_profile")},
        "calls_per_episode": report.get("calls_per_episode"),
        "run_dir": report.get("run_dir"),
    }


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


def compact(report: dict[str, Any]) -> dict[str, Any]:
    """A run's outcomes as the results file keeps them: per split and version, the solved flags as a string of
    0/1, the failure kinds and the episode rewards (runs before 2026-12-07 kept none); the task ids and templates
    once per split."""
    kept: dict[str, Any] = {}
    for split, data in (report.get("outcomes") or {}).items():
        kept[split] = {
            "tasks": data["tasks"],
            "templates": data["templates"],
            "by_version": {
                version: {"solved": "".join("1" if s else "0" for s in v["solved"]), "failures": v["failures"]}
                | ({"rewards": v["rewards"]} if "rewards" in v else {})
                for version, v in data["by_version"].items()
            },
        }
    return kept


def expand(outcomes: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`compact` for the flags."""
    return {
        split: data
        | {
            "by_version": {
                version: v | {"solved": [c == "1" for c in v["solved"]]} for version, v in data["by_version"].items()
            }
        }
        for split, data in outcomes.items()
    }


def run_part(
    name: str, arm: str, seed: int, args: argparse.Namespace, matmul: float, sft_tokens: int | None
) -> dict[str, Any]:
    """One part of the protocol (module docstring); its figures and compacted outcomes. ``sft_tokens``: the SFT
    baseline's budget; for ``replay``, the store of the real run it replays (passed as its path, a str)."""
    extra = ["--seed", str(seed)]
    if arm == "replay":
        extra += ["--replay-store", str(sft_tokens)]
    elif arm == "control":
        extra += ["--shuffle-rewards"]
    elif arm == "sft":
        extra += ["--steps", "0", "--sft-tokens", str(sft_tokens)]
    elif arm == "zero_shot":
        extra += ["--steps", "0", "--warmup-steps", "0"]
    print(f"--- {name} {arm} seed {seed}", file=sys.stderr, flush=True)
    report = run_example(name, args, *extra)
    if "error" in report:
        return report
    return figures(report, matmul) | {
        "outcomes": compact(report),
        "seed": seed,
        "arm": arm,
        "sft_tokens": report.get("sft_tokens"),
    }


def reclassified(name: str, run: dict[str, Any]) -> dict[str, Any] | None:
    """``run``'s outcomes read again from its store (``<run dir>/chdb``, opened by ``fulmen sql``) with the example's
    current failure kinds, compacted; None when the store is gone. For a part that ran before its example could name
    its failures: the episodes are the same, only their kinds are new."""
    store = Path(run.get("run_dir") or "/nonexistent") / "chdb"
    if not store.is_dir():
        return None
    from types import SimpleNamespace

    from examples.outcomes import outcomes_by_split, validation_episodes
    from examples.train import ExampleOptions, dataset, load_example, sql

    kept = run.get("settings") or {}
    options = ExampleOptions(
        train=kept.get("train", 2000),
        heldout=kept.get("heldout", 200),
        unseen=kept.get("unseen", 200),
        max_tokens=kept.get("max_tokens") or None,
    )
    reader = SimpleNamespace(env={"FULMEN_CLICKHOUSE_PATH": str(store)})
    example = load_example(name)
    return compact(outcomes_by_split(example, dataset(example, options), validation_episodes(reader, "fulmen", sql)))


def replayed_store(runs: dict[str, Any], seed: int) -> str | None:
    """The store of the real run of ``seed`` (what its replay arm trains on), when it is still on this disk."""
    run_dir = (runs.get(f"real/{seed}") or {}).get("run_dir")
    store = Path(run_dir) / "chdb" if run_dir else None
    return str(store) if store is not None and store.is_dir() else None


def replay_figures(runs: dict[str, Any]) -> dict[str, Any]:
    """``replay_fraction``: the gain of training a fresh copy of the warmed-up model by replay only, on the stored
    rollouts of the real run of the same seed, over that real run's gain, pooled over the seeds that have both (on
    the same held-out tasks), with a paired bootstrap interval (``scenario_stats.ratio_interval``)."""
    seeds = [k.split("/")[1] for k in sorted(runs) if k.startswith("replay/") and "outcomes" in runs[k]]
    seeds = [s for s in seeds if "outcomes" in runs.get(f"real/{s}", {})]
    if not seeds:
        return {"replay_fraction": None, "replay_ci95": None, "replay_seeds": 0}
    replayed = _pairs([runs[f"replay/{s}"] for s in seeds], "heldout")
    on_policy = _pairs([runs[f"real/{s}"] for s in seeds], "heldout")
    ratio = ratio_interval(replayed, on_policy)
    return {
        "replay_fraction": ratio.get("ratio"),
        "replay_ci95": ratio.get("ci95"),
        "replay_seeds": len(seeds),
        "replay_gain": pooled_gain(replayed)["gain"],
        "replay_gain_ci95": pooled_gain(replayed)["ci95"],
        "replay_on_policy_gain": pooled_gain(on_policy)["gain"],
        "replay_gain_by_seed": [round(accuracy(a) - accuracy(b), 4) for b, a in replayed],
    }


def tokens_of_real_runs(runs: dict[str, Any]) -> int | None:
    """Tokens the real runs trained on, on average (tokens a step x steps): the SFT baseline's budget."""
    trained = [
        r["tokens_trained_per_step"] * r["steps"]
        for key, r in runs.items()
        if key.startswith("real/") and r.get("tokens_trained_per_step") and r.get("steps")
    ]
    return round(sum(trained) / len(trained)) if trained else None


def _pairs(runs: list[dict[str, Any]], split: str) -> list[tuple[list[bool], list[bool]]]:
    pairs = [before_after(expand(r["outcomes"])[split]) for r in runs if split in (r.get("outcomes") or {})]
    return [p for p in pairs if p is not None]


def _only_version(run: dict[str, Any] | None, split: str) -> float | None:
    """An evaluation run's accuracy on ``split`` (its one validated version)."""
    data = expand((run or {}).get("outcomes") or {}).get(split)
    if not data or not data["by_version"]:
        return None
    return accuracy(data["by_version"][sorted(data["by_version"], key=int)[-1]]["solved"])


def summary(name: str, runs: dict[str, Any]) -> dict[str, Any]:
    """The issue's keys for one scenario, from every part the results file holds."""
    real = [runs[k] for k in sorted(runs) if k.startswith("real/") and "outcomes" in runs[k]]
    out: dict[str, Any] = {"seeds": len(real), "model": MODEL}
    for split in ("heldout", "unseen"):
        pairs = _pairs(real, split)
        if not pairs:
            continue
        pooled = pooled_gain(pairs)
        out |= {
            f"{split}_before": round(sum(accuracy(b) for b, _ in pairs) / len(pairs), 4),
            f"{split}_after": round(sum(accuracy(a) for _, a in pairs) / len(pairs), 4),
            f"{split}_gain": pooled["gain"],
            f"{split}_ci95": pooled["ci95"],
            f"{split}_n": pooled["n"],
            f"{split}_gain_by_seed": [round(accuracy(a) - accuracy(b), 4) for b, a in pairs],
            f"{split}_seed_ci95": seed_interval([accuracy(a) - accuracy(b) for b, a in pairs]),
        }
        rewards = [r for r in (_mean_rewards(run, split) for run in real) if r is not None]
        if rewards:  # the mean episode reward (RAG: answer F1, where solved is exact match), runs that kept it
            out[f"{split}_reward_before"] = round(sum(b for b, _ in rewards) / len(rewards), 4)
            out[f"{split}_reward_after"] = round(sum(a for _, a in rewards) / len(rewards), 4)
        templates = expand(real[0]["outcomes"])[split]["templates"]
        out.setdefault("by_template", {})[split] = by_template(templates, pairs)
    out["gain_by_seed"] = out.pop("heldout_gain_by_seed", None)
    for when, index in (("before", 0), ("after", -1)):  # per split: the mean count per run of each kind
        by_split: dict[str, Any] = {}
        for run in real:
            for split, data in expand(run["outcomes"]).items():
                versions = sorted(data["by_version"], key=int)
                by_split.setdefault(split, []).append(data["by_version"][versions[index]]["failures"])
        out[f"failures_{when}"] = {split: failure_counts(kinds) for split, kinds in by_split.items()} or None
    control = runs.get("control/0")
    for split, key in (("heldout", "control"), ("unseen", "control_unseen")):  # the unseen split too: a skeptic
        pairs = _pairs([control], split) if control and "outcomes" in control else []  # asks what noise alone does
        out[f"{key}_delta"] = pooled_gain(pairs)["gain"] if pairs else None
        out[f"{key}_ci95"] = pooled_gain(pairs)["ci95"] if pairs else None
    out["sft_baseline_after"] = _only_version(runs.get("sft/0"), "heldout")
    out["sft_baseline_unseen"] = _only_version(runs.get("sft/0"), "unseen")
    out["sft_tokens"] = (runs.get("sft/0") or {}).get("sft_tokens")
    out |= replay_figures(runs)
    out["zero_shot"] = _only_version(runs.get("zero_shot/0"), "heldout")
    out["zero_shot_unseen"] = _only_version(runs.get("zero_shot/0"), "unseen")
    steps = [r["s_per_step"] for r in real if r.get("s_per_step")]
    out["s_per_step"] = round(sum(steps) / len(steps), 2) if steps else None
    # the whole process where it was kept, else the run from its stack's start (the warm-up not counted)
    out["wall_s_by_part"] = {k: r.get("process_wall_s") or r.get("wall_s") for k, r in sorted(runs.items())}
    out["wall_s"] = round(sum(w or 0 for w in out["wall_s_by_part"].values()), 1)
    # before the stack starts: the model made ready, the warm-up (or the SFT baseline's training) unless cached
    out["setup_s_by_part"] = {
        k: round(r["process_wall_s"] - r["wall_s"], 1)
        for k, r in sorted(runs.items())
        if r.get("process_wall_s") and r.get("wall_s")
    }
    out["engine"] = next((r.get("engine") for r in real), None)
    out["profile"] = {k: (r.get("profile") or {}).get("step") for k, r in sorted(runs.items())}
    return out


def _mean_rewards(run: dict[str, Any], split: str) -> tuple[float, float] | None:
    """The mean episode reward of ``split`` at the run's first and last validated versions, where it kept them."""
    data = expand(run.get("outcomes") or {}).get(split)
    if not data:
        return None
    versions = [data["by_version"][v] for v in sorted(data["by_version"], key=int)]
    if "rewards" not in versions[0] or "rewards" not in versions[-1]:
        return None
    return tuple(sum(v["rewards"]) / max(len(v["rewards"]), 1) for v in (versions[0], versions[-1]))  # type: ignore[return-value]


def curve(run: dict[str, Any], split: str) -> list[tuple[int, float]]:
    """``(version, accuracy)`` at every validated version of one run."""
    data = expand(run.get("outcomes") or {}).get(split)
    if not data:
        return []
    return [(int(v), accuracy(data["by_version"][v]["solved"]) or 0.0) for v in sorted(data["by_version"], key=int)]


def plot(results: dict[str, Any], path: Path) -> None:
    """Per scenario: held-out accuracy by step for every seed and the control, the unseen split's before/after,
    the baselines as lines, and the pooled interval of the gain (inside 0-100%)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in SCENARIOS if (results.get(n) or {}).get("runs")]
    if not names:
        return
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        runs, summed = results[name]["runs"], results[name].get("summary") or {}
        for key in sorted(runs):
            arm = key.split("/")[0]
            for split, style in (("heldout", "-o"), ("unseen", ":^")):
                points = curve(runs[key], split)
                if arm in ("real", "control") and points:
                    label = f"{'GRPO' if arm == 'real' else 'control'} seed {key.split('/')[1]} ({split})"
                    ax.plot(
                        [s for s, _ in points],
                        [100 * a for _, a in points],
                        style if arm == "real" else "--s",
                        alpha=0.8,
                        label=label,
                    )
        for label, key, style in (("SFT baseline", "sft_baseline_after", "g-."), ("zero-shot", "zero_shot", "k:")):
            if summed.get(key) is not None:
                ax.axhline(100 * summed[key], linestyle=style[1:], color=style[0], label=f"{label} (held-out)")
        ci, before = summed.get("heldout_ci95"), summed.get("heldout_before")
        if ci and before is not None:
            last = max(s for key in runs if key.startswith("real/") for s, _ in curve(runs[key], "heldout") or [(0, 0)])
            low, high = (max(0.0, min(1.0, before + x)) for x in ci)
            ax.errorbar(
                [last],
                [100 * (low + high) / 2],
                yerr=[[100 * (high - low) / 2]],
                fmt="none",
                capsize=4,
                color="black",
                label="pooled 95% interval of the gain",
            )
        ax.set_ylim(0, 100)
        ax.set_title(f"{name} (held-out n={summed.get('heldout_n')}, unseen n={summed.get('unseen_n')})")
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("% solved (greedy, through the system)")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def _points(interval: list[float] | None) -> str:
    return "-" if not interval else f"[{100 * interval[0]:+.1f}, {100 * interval[1]:+.1f}]"


def markdown(name: str, summed: dict[str, Any]) -> str:
    """The docs' table for one scenario, from its summary (what ``--markdown`` prints)."""
    seeds = ", ".join(f"{100 * g:+.1f}" for g in summed.get("gain_by_seed") or [])
    rows = [
        "| split | before | after | mean gain (points) | pooled 95% interval | per seed |",
        "|---|---|---|---|---|---|",
        f"| held-out, in distribution (n={summed.get('heldout_n')}) | {_pct(summed.get('heldout_before'))} | "
        f"{_pct(summed.get('heldout_after'))} | {100 * (summed.get('heldout_gain') or 0):+.1f} | "
        f"{_points(summed.get('heldout_ci95'))} | {seeds} |",
        f"| unseen shapes (n={summed.get('unseen_n')}) | {_pct(summed.get('unseen_before'))} | "
        f"{_pct(summed.get('unseen_after'))} | {100 * (summed.get('unseen_gain') or 0):+.1f} | "
        f"{_points(summed.get('unseen_ci95'))} | "
        + ", ".join(f"{100 * g:+.1f}" for g in summed.get("unseen_gain_by_seed") or [])
        + " |",
    ]
    control = (
        f"{100 * summed['control_delta']:+.1f} points {_points(summed.get('control_ci95'))} (unseen shapes: "
        f"{100 * (summed.get('control_unseen_delta') or 0):+.1f} {_points(summed.get('control_unseen_ci95'))})"
        if summed.get("control_delta") is not None
        else "not run yet"
    )
    baselines = (
        f"Held-out / unseen: zero-shot (no warm-up) {_pct(summed.get('zero_shot'))} / "
        f"{_pct(summed.get('zero_shot_unseen'))}; equal-compute SFT ({summed.get('sft_tokens')} tokens) "
        f"{_pct(summed.get('sft_baseline_after'))} / {_pct(summed.get('sft_baseline_unseen'))}; "
        f"shuffled-reward control on held-out: {control}."
    )
    return (
        f"**{name}** ({summed.get('seeds')} seed(s))\n\n"
        + "\n".join(rows)
        + "\n\n"
        + baselines
        + "\n\n"
        + _breakdowns(summed)
    )


def _breakdowns(summed: dict[str, Any]) -> str:
    """Per template and per failure kind, before -> after (means over the seeds)."""
    lines = ["| split | template | n | before | after |", "|---|---|---|---|---|"]
    for split, table in (summed.get("by_template") or {}).items():
        lines += [
            f"| {split} | `{name}` | {row['n']} | {_pct(row['before'])} | {_pct(row['after'])} |"
            for name, row in table.items()
        ]
    lines += ["", "| split | outcome | before | after |", "|---|---|---|---|"]
    before, after = summed.get("failures_before") or {}, summed.get("failures_after") or {}
    for split in before:
        kinds = sorted(set(before[split]) | set(after.get(split, {})))
        lines += [
            f"| {split} | `{kind}` | {before[split].get(kind, 0):g} | {after.get(split, {}).get(kind, 0):g} |"
            for kind in kinds
        ]
    return "\n".join(lines) + "\n"


def load_results(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{path}: not JSON ({exc}); move it away to start afresh") from exc


def save_results(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    temporary.replace(path)


def parts(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The (arm, seed) parts asked for, in the order they run (the SFT baseline after the real runs)."""
    chosen = []
    for arm in ARMS:
        if arm in args.arms:
            seeds = args.seed if args.seed is not None else range(args.seeds)
            chosen += [(arm, s) for s in seeds] if arm in ("real", "replay") else [(arm, 0)]
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=SCENARIOS, action="append", help="run only these (repeatable)")
    parser.add_argument(
        "--arms", type=lambda text: text.split(","), default=list(ARMS), help=f"comma-separated, of {', '.join(ARMS)}"
    )
    parser.add_argument("--seeds", type=int, default=3, help="real runs (seeds 0..N-1)")
    parser.add_argument(
        "--seed", type=int, action="append", help="run only these seeds of the real and replay arms (repeatable)"
    )
    parser.add_argument("--rerun", action="store_true", help="run parts the results file already holds again")
    parser.add_argument("--report-only", action="store_true", help="run nothing: the summary of the results file")
    parser.add_argument(
        "--reclassify", action="store_true", help="run nothing: read the kept stores' outcomes again (failure kinds)"
    )
    parser.add_argument("--markdown", action="store_true", help="also print the docs' table of each scenario")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--train", type=int, default=2000, help="training tasks (each step takes the next groups)")
    parser.add_argument("--heldout", type=int, default=200)
    parser.add_argument("--unseen", type=int, default=200, help="problems of the unseen-shapes split")
    parser.add_argument("--val-every", type=int, default=0, help="validate every N steps too (0: before and after)")
    parser.add_argument("--max-tokens", type=int, default=0, help="per LLM call; 0: the agent's default")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--kl-coef", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=1, help="PPO passes over each step's batch")
    parser.add_argument("--lora-r", type=int, default=0, help="LoRA rank (0: every weight trains)")
    parser.add_argument("--micro-batch-tokens", type=int, default=2048, help="prefix-tree micro-batches")
    parser.add_argument("--warmup-steps", type=int, default=8)
    parser.add_argument("--warmup-tasks", type=int, default=32)
    parser.add_argument("--warmup-lr", type=float, default=1e-4)
    parser.add_argument("--sft-tasks", type=int, default=512, help="training tasks the SFT baseline learns from")
    parser.add_argument(
        "--concurrency", type=int, default=32, help="rollouts a runner runs at once (a step's episodes in one wave)"
    )
    parser.add_argument("--llm-context", type=int, default=1024, help="llamacpp: KV tokens per slot")
    parser.add_argument("--rollout-timeout-s", type=float, default=900.0)
    parser.add_argument("--engine", default="llamacpp", help="the LLM gateway's backend (transformers, llamacpp)")
    parser.add_argument("--home", type=Path, default=Path.home() / ".cache" / "fulmen" / "bench-scenarios")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="the figure (default: the docs' one for the protocol's results file, else beside --results)",
    )
    args = parser.parse_args()
    unknown = sorted(set(args.arms) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    if args.plot is None:  # another results file (an exploration) never redraws the docs' figure of the protocol
        args.plot = PLOT if args.results.resolve() == RESULTS else args.results.with_suffix(".png")
    results = load_results(args.results)
    args.report_only |= args.reclassify
    matmul = matmul_rate() if not args.report_only else None
    for name in args.only or SCENARIOS:
        runs = results.setdefault(name, {}).setdefault("runs", {})
        for key in sorted(runs) if args.reclassify else []:
            again = reclassified(name, runs[key])
            print(f"--- {name} {key}: {'reclassified' if again else 'its store is gone; kept'}", file=sys.stderr)
            runs[key] |= {"outcomes": again} if again else {}
        for arm, seed in [] if args.report_only else parts(args):
            key = f"{arm}/{seed}"
            if key in runs and "error" not in runs[key] and not args.rerun:
                continue
            budget = tokens_of_real_runs(runs) if arm == "sft" else None
            if arm == "sft" and not budget:
                print(f"--- {name} sft: no real run to match the compute of yet; skipped", file=sys.stderr)
                continue
            if arm == "replay":
                budget = replayed_store(runs, seed)
                if budget is None:
                    print(f"--- {name} replay/{seed}: the store of real/{seed} is gone; skipped", file=sys.stderr)
                    continue
            runs[key] = run_part(name, arm, seed, args, matmul or 0.0, budget)
            runs[key]["settings"] = {
                k: (str(v) if isinstance(v, Path) else v)
                for k, v in vars(args).items()
                if k not in ("only", "arms", "rerun", "report_only", "seed")
            } | {"matmul_gflops": matmul, "loadavg": os.getloadavg(), "finished": time.strftime("%Y-%m-%d %H:%M")}
            save_results(args.results, results)  # the part is kept before anything else can fail
        results[name]["summary"] = summary(name, runs)
    save_results(args.results, results)
    plot(results, args.plot)
    if args.markdown:
        for name in args.only or SCENARIOS:
            print(markdown(name, results[name]["summary"]), file=sys.stderr)
    printed = {name: results[name]["summary"] for name in args.only or SCENARIOS} | {"results": str(args.results)}
    print(json.dumps(printed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
