"""The demo's report: accuracy before/after, the curves as a PNG, and SQL queries a user can run next.

Accuracy is the trainer's validation (held-out tasks run greedily through the whole system):
``initial_val_accuracy`` of step 1 is "before", the last ``val_accuracy`` is "after". The curve has the
training reward mean of every step and the held-out accuracy at each validation.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fulmen.algorithm.demo.run import DemoRun
from fulmen.infra.processes import FULMEN

__all__ = ["QueryResult", "accuracy_curve", "demo_queries", "report_dict", "run_queries"]


@dataclass(frozen=True)
class QueryResult:
    title: str
    sql: str
    output: str
    ok: bool


def accuracy_curve(run: DemoRun) -> list[tuple[int, float]]:
    """``(model version, held-out accuracy)`` points: version 0 (before training), then each validation."""
    return run.accuracy_curve()


def report_dict(
    run: DemoRun, plot: Path | None, shuffle_rewards: bool, algorithm: str = "grpo", mode: str = "sync"
) -> dict[str, Any]:
    """The JSON report (``fulmen demo --json``'s last line)."""
    curve = accuracy_curve(run)
    return {
        "run_id": run.run_id,
        "shuffle_rewards": shuffle_rewards,
        "algorithm": algorithm,
        "mode": mode,
        "steps": len(run.steps),
        "accuracy_before": curve[0][1] if curve else None,
        "accuracy_after": curve[-1][1] if len(curve) > 1 else None,
        "accuracy_curve": curve,
        "reward_curve": [(s.step, round(s.reward_mean, 4)) for s in run.steps],
        "wall_s": round(run.wall_s, 1),
        "warmup_s": round(run.warmup_s, 1),
        "startup_s": round(run.startup_s, 1),
        "train_s": round(run.train_s, 1),
        "mean_rollout_wait_s": _mean([s.rollout_wait_s for s in run.steps]),
        "mean_update_s": _mean([s.train_s for s in run.steps]),
        "run_dir": str(run.run_dir),
        "final_model": str(run.final_model) if run.final_model else None,
        "plot": str(plot) if plot else None,
        "store": str(run.store_path),
    }


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


def demo_queries(run: DemoRun, database: str) -> list[tuple[str, str]]:
    """``(title, SQL)`` of the queries the demo shows, all scoped to this run's data."""
    db = database
    return [
        (
            "training steps",
            f"SELECT Step, round(RewardMean, 3) AS Reward, if(mapContains(Extra, 'val_accuracy'), "
            f"round(Extra['val_accuracy'], 3), NULL) AS HeldOutAccuracy, NumTransitions, round(RolloutWaitS, 1) AS "
            f"WaitS, round(TrainS, 1) AS TrainS "
            f"FROM {db}.train_steps WHERE RunId = '{run.run_id}' ORDER BY Step",
        ),
        (
            "rollouts by mode and status",
            f"SELECT Mode, Status, count() AS Rollouts, round(avg(Reward), 3) AS "
            f"Reward FROM {db}.rollouts GROUP BY Mode, Status ORDER BY Mode, Status",
        ),
        (
            "transitions per call of the episode",
            f"SELECT CallIndex, count() AS Calls, round(avg(length("
            f"PromptTokenIds))) AS PromptTokens, round(avg(length(ResponseTokenIds))) AS ResponseTokens, "
            f"round(avg(EpisodeReward), 3) AS Reward FROM {db}.transitions GROUP BY CallIndex ORDER BY CallIndex",
        ),
        (
            "LLM calls recorded by the gateway, per model version",
            f"SELECT ModelVersion, count() AS Calls, "
            f"round(avg(Duration) / 1e6, 1) AS AvgMs FROM {db}.otel_traces WHERE ServiceName = 'fulmen-llm-gateway' "
            f"GROUP BY ModelVersion ORDER BY ModelVersion",
        ),
    ]


def run_queries(run: DemoRun, database: str, timeout_s: float = 60.0) -> list[QueryResult]:
    """Run each demo query once with ``fulmen sql`` (answered by the run's ``fulmen consume``)."""
    env = {**os.environ, **run.env, "COLUMNS": os.environ.get("COLUMNS", "160")}
    results = []
    for title, sql in demo_queries(run, database):
        done = subprocess.run(
            [*FULMEN, "sql", sql], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        results.append(QueryResult(title, sql, (done.stdout or done.stderr).rstrip(), done.returncode == 0))
    return results
