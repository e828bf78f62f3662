"""The improvement loop on a real model (issue 44): production traffic, late feedback, ``fulmen improve``, the gate.

SmolLM2-135M-Instruct after the calc example's warm-up (the scenario bench's: 8 supervised steps on the teacher's
demonstrations of 32 training tasks), on the two cores, one arm at a time, each on its own stack
(:func:`fulmen.algorithm.local.local_stack`: Kafka, ``fulmen consume``, the OTLP gateway, the training LLM gateway
and a runner of the calc agent for the held-out tasks), plus:

- a production LLM gateway (``FULMEN_LLM_FOLLOW=promoted``: it serves what is promoted, the warmed-up model until
  then) that an agent process (``bench/improve_traffic.py``: the calc agent unchanged, instrumented as a user's
  would be) sends production traffic to at ``--per-min`` episodes a minute, and whose judge process posts each
  episode's reward as feedback for its trace 5-60 s after the answer;
- ``fulmen improve`` (the command, in its own process) with rounds every ``--every`` seconds: it trains on the
  production episodes with a reward that ended since the last round (``--steps-per-round`` steps at most, GRPO
  over batches of ``--group-size`` episodes: production episodes have no groups), validates each version
  greedily on ``--heldout`` held-out problems through the system and promotes it only when it beats the serving
  version by the paired test.

Arms: ``real``; ``control`` (the judge's rewards permuted within blocks of 16 episodes: the gate must refuse every
round). Each finished arm is merged into ``--results`` (``bench/results/improve.json``) and skipped on the next
run unless ``--rerun``. The replay measurement (``replay_fraction``) is the scenario bench's (its ``replay`` arm on
the calc example: ``bench/scenarios.py --only calc_agent --arms real,replay``), read from its results file, and
reported as not measured while that has none.

    .venv/bin/python bench/improve.py --arms real --minutes 60
    .venv/bin/python bench/improve.py --arms control --minutes 60

Last line: one JSON object: ``rounds``, ``promoted``, ``refused``, ``heldout_by_round``, ``heldout_start``,
``heldout_end``, ``failed_calls_during_promotion``, ``control_promoted``, ``replay_fraction``, ``replay_ci95``,
``wall_s`` (and per arm the details, ``results``: the file).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the examples package
RESULTS = ROOT / "bench" / "results" / "improve.json"
SCENARIOS = ROOT / "bench" / "results" / "scenarios.json"  # where the replay measurement lives (calc_agent)
ARMS = ("real", "control")
PROMOTED_AT = "SELECT toUnixTimestamp64Micro(CreatedAt) / 1e6 AS t FROM fulmen.promotions WHERE Action = 'promote'"
PRODUCTION = (
    "SELECT RolloutId FROM fulmen.rollouts WHERE Mode = 'production' "
    "AND RolloutId IN (SELECT RolloutId FROM fulmen.feedback WHERE Name = 'reward')"
)


def prepared_model(args: argparse.Namespace) -> tuple[Path, dict[str, str], list[dict[str, Any]]]:
    """The warmed-up SmolLM2, the gateway variables it needs, and the held-out task inputs."""
    from examples.train import ExampleOptions, load_example, resolve_model, warmed_up

    example = load_example("calc_agent")
    options = ExampleOptions(model="smollm2", warmup_steps=8, warmup_tasks=32, warmup_lr=1e-4)
    model, llm_env = resolve_model("smollm2", args.home)
    model = warmed_up(example, options, model, llm_env, args.home, lambda text: print(text, file=sys.stderr))
    return model, llm_env, example.heldout_tasks(args.heldout)


def training_env(args: argparse.Namespace) -> dict[str, str]:
    """``FULMEN_TRAIN_*`` of the rounds: the calc protocol's GRPO settings, replay from production."""
    fields = {
        "group_size": args.group_size,
        "groups_per_step": 4,
        "lr": 1e-5,
        "micro_batch_tokens": 2048,
        "micro_batch_size": 8,
        "max_staleness": 1000,
        "val_group_size": 1,
        "rollout_timeout_s": 900,
        "device": "cpu",
        "dtype": "float32",
        "report_to": "none",
    }
    return {f"FULMEN_TRAIN_{name.upper()}": str(value) for name, value in fields.items()}


def production_gateway(services: Any, model: Path, llm_env: dict[str, str], port: int) -> str:
    """A second LLM gateway that serves what is promoted; its /v1."""
    from fulmen.infra.processes import ServiceSpec

    env = llm_env | {
        "FULMEN_LLM_MODEL": str(model),
        "FULMEN_LLM_PORT": str(port),
        "FULMEN_LLM_MODEL_VERSION": "0",
        "FULMEN_LLM_FOLLOW": "promoted",
        "FULMEN_LLM_BACKEND": "llamacpp",
        "FULMEN_LLM_LLAMACPP_SLOTS": "4",
        "FULMEN_LLM_LLAMACPP_CONTEXT": "1024",
        "FULMEN_LLM_DEVICE": "cpu",
    }
    services.start(ServiceSpec("llm-production", ("llm-gateway",), env, f"http://127.0.0.1:{port}/readyz"))
    return f"http://127.0.0.1:{port}/v1"


def run_arm(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    """One arm on its own stack (module docstring); its figures."""
    from harness import MemorySampler, resident_mb

    from examples.train import sql
    from fulmen.algorithm.local import LocalPlan, local_stack
    from fulmen.infra.processes import free_port
    from fulmen.infra.settings import FulmenSettings

    model, llm_env, heldout = prepared_model(args)
    started = time.perf_counter()
    settings = FulmenSettings.model_validate({"home": args.home})
    slots = {"FULMEN_LLM_BACKEND": "llamacpp", "FULMEN_LLM_LLAMACPP_SLOTS": "32", "FULMEN_LLM_LLAMACPP_CONTEXT": "1024"}
    plan = LocalPlan(
        "examples.calc_agent.agent:run", model, concurrency=32, llm_env=llm_env | slots, run_prefix=f"improve-{arm}"
    )
    with local_stack(settings, plan, on_phase=lambda text: print(text, file=sys.stderr)) as stack:
        run = stack.run
        out = run.run_dir / "bench"
        out.mkdir(parents=True, exist_ok=True)
        val = out / "val.jsonl"
        val.write_text("".join(json.dumps(task) + "\n" for task in heldout))
        production = production_gateway(stack.services, model, llm_env, free_port())
        env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | run.env | training_env(args)
        traffic_command = [sys.executable, str(ROOT / "bench" / "improve_traffic.py"), "--base-url", production]
        traffic_command += ["--otlp", stack.ports.otlp_url, "--per-min", str(args.per_min), "--out", str(out)]
        traffic = _started(traffic_command + (["--shuffle"] if arm == "control" else []), env, out / "traffic.log")
        improve_command = [sys.executable, "-m", "fulmen.cli.main", "improve", "--run", f"{run.run_id}-improve"]
        improve_command += ["--run-dir", str(run.run_dir / "improve"), "--model", str(model), "--val", str(val)]
        improve_command += ["--every", f"{args.every}s", "--settle", "70s", "--replay", PRODUCTION]
        improve_command += ["--steps-per-round", str(args.steps_per_round)]
        improve = _started(improve_command, env, out / "improve.log")
        deadline, memory = time.monotonic() + 60 * args.minutes, []
        with MemorySampler(improve.pid, 1.0) as sampler:
            while time.monotonic() < deadline and improve.poll() is None and traffic.poll() is None:
                time.sleep(5)
                if len(memory) < (time.monotonic() - deadline + 60 * args.minutes) // 60:
                    memory.append(round(sum(resident_mb(improve.pid).values())))  # a sample a minute
        for process in (improve, traffic):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in (improve, traffic):
            try:
                process.wait(timeout=600)
            except subprocess.TimeoutExpired:
                process.kill()
        promoted_at = [float(row["t"]) for row in sql(run, PROMOTED_AT)]
        figures = arm_figures(run.run_dir / "improve", out, promoted_at)
        figures |= {"improve_memory": sampler.peaks(), "improve_rss_mb_by_minute": memory}
    return figures | {"wall_s": round(time.perf_counter() - started, 1), "run_dir": str(run.run_dir)}


def _started(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def arm_figures(improve_dir: Path, out: Path, promoted_at: list[float]) -> dict[str, Any]:
    """What one arm did: its rounds, decisions, the serving version's held-out accuracy after each, failed calls
    (those within a minute after a promotion, when the production gateway swaps, apart)."""
    from fulmen.algorithm.service.reporting import read_metrics

    book = json.loads((improve_dir / "improve.json").read_text()) if (improve_dir / "improve.json").is_file() else {}
    rounds = [r for r in book.get("rounds", []) if r.get("done")]
    metrics = read_metrics(improve_dir / "metrics.jsonl")
    start = next((row["extra/initial_val_accuracy"] for row in metrics if "extra/initial_val_accuracy" in row), None)
    by_round, serving = [], start
    for done in rounds:
        serving = done.get("serving_score") if done.get("serving_score") is not None else serving
        by_round.append(serving)
    episodes = _lines(out / "episodes.jsonl")
    failed = _lines(out / "failed.jsonl")
    posted = _lines(out / "feedback.jsonl")
    swapping = [f for f in failed if any(at - 5 <= f["t"] <= at + 60 for at in promoted_at)]
    return {
        "rounds": len(rounds),
        "promoted": [v for r in rounds for v in r.get("promoted", [])],
        "refused": [v for r in rounds for v in r.get("rejected", [])],
        "heldout_start": start,
        "heldout_by_round": by_round,
        "heldout_end": by_round[-1] if by_round else start,
        "steps": max((int(row["step"]) for row in metrics), default=0),
        "episodes_served": len(episodes),
        "production_accuracy": round(sum(e["reward"] for e in episodes) / len(episodes), 4) if episodes else None,
        "feedback_posted": sum(1 for row in posted if row.get("status") == 202),
        "failed_calls": len(failed),
        "failed_calls_during_promotion": len(swapping),
        "promotions_at": promoted_at,
        "rounds_detail": rounds,
    }


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's keys from the arms the results file holds."""
    real, control = results.get("real") or {}, results.get("control") or {}
    return {
        "rounds": real.get("rounds"),
        "promoted": real.get("promoted"),
        "refused": real.get("refused"),
        "heldout_by_round": real.get("heldout_by_round"),
        "heldout_start": real.get("heldout_start"),
        "heldout_end": real.get("heldout_end"),
        "failed_calls_during_promotion": real.get("failed_calls_during_promotion"),
        "control_promoted": control.get("promoted") if control else None,
        "control_refused": control.get("refused") if control else None,
        **replay_measured(),
        "wall_s": round(sum(a.get("wall_s", 0.0) for a in (real, control)), 1),
    }


def plot(results: dict[str, Any], path: Path) -> None:
    """The serving version's held-out accuracy over the run, per arm: the start, then after each round (a step at
    the round's end), with the promotions marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for arm, style in (("real", "-o"), ("control", "--s")):
        data = results.get(arm) or {}
        rounds = [r for r in data.get("rounds_detail") or [] if r.get("ended_at")]
        if not rounds or data.get("heldout_start") is None:
            continue
        origin = rounds[0]["started_at"]
        minutes = [0.0] + [(r["ended_at"] - origin) / 60 for r in rounds]
        served = [data["heldout_start"]] + [
            v if v is not None else data["heldout_start"] for v in data["heldout_by_round"]
        ]
        label = "judge's rewards" if arm == "real" else "rewards shuffled (control)"
        ax.step(minutes, [100 * v for v in served], style, where="post", label=label)
        for at in data.get("promotions_at") or []:
            ax.axvline((at - origin) / 60, color="g", alpha=0.3)
    ax.set_xlabel("minutes since the first round (green: a promotion)")
    ax.set_ylabel("served version, held-out accuracy (%)")
    ax.set_ylim(0, 100)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replay_measured() -> dict[str, Any]:
    """``replay_fraction`` and ``replay_ci95`` as the scenario bench measured them (its ``replay`` arm on the calc
    example: a fresh warmed-up model trained by replay only on the rollouts each real seed stored)."""
    calc = (json.loads(SCENARIOS.read_text()) if SCENARIOS.is_file() else {}).get("calc_agent", {}).get("summary", {})
    if calc.get("replay_fraction") is None:
        return {
            "replay_fraction": None,
            "replay_ci95": None,
            "not_measured": ["replay_fraction: bench/scenarios.py --only calc_agent --arms real,replay"],
        }
    keys = ("replay_fraction", "replay_ci95", "replay_seeds", "replay_gain", "replay_on_policy_gain")
    return {key: calc.get(key) for key in keys} | {"replay_from": str(SCENARIOS)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", type=lambda text: text.split(","), default=list(ARMS))
    parser.add_argument("--minutes", type=float, default=60.0, help="how long each arm runs")
    parser.add_argument("--every", type=float, default=600.0, help="seconds between rounds")
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8, help="production episodes per GRPO batch")
    parser.add_argument("--per-min", type=float, default=12.0, help="production episodes a minute")
    parser.add_argument("--heldout", type=int, default=200)
    parser.add_argument("--rerun", action="store_true")
    parser.add_argument("--home", type=Path, default=Path.home() / ".cache" / "fulmen" / "bench-scenarios")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "improve_serving.png")
    args = parser.parse_args()
    results = json.loads(args.results.read_text()) if args.results.is_file() else {}
    for arm in args.arms:
        if arm not in ARMS:
            parser.error(f"--arms: {arm}? choose from {', '.join(ARMS)}")
        if arm in results and not args.rerun:
            continue
        results[arm] = run_arm(arm, args) | {"settings": {k: str(v) for k, v in vars(args).items()}}
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=1) + "\n")
    results["summary"] = summary(results)
    args.results.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.plot)
    print(json.dumps(results["summary"] | {"results": str(args.results)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
