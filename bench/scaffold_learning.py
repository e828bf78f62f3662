"""Does the `fulmen init` project learn? The scaffold README's command, per seed, measured on its 200 held-out tasks.

Per seed: a fresh ``fulmen init`` project; ``fulmen.train`` with exactly what the README's third command sets
(``agent:run`` on ``train.jsonl``, validated on ``val.jsonl``, ``--model smollm2 --warmup-teacher teacher:teach
--warmup-steps 8 --steps 20 --keep-checkpoints 2``, the settings' defaults otherwise) and ``--seed``; then the
run's own store (``<run dir>/chdb``) is asked with SQL which validation tasks each validated version solved
(``examples.outcomes.validation_episodes``, the query a user would write): version 0 is the warmed-up model
before the first GRPO step, the last one the model after it. The base model without the warm-up is validated
once too (``--steps 0``, no teacher) for the zero-shot figure.

    .venv/bin/python bench/scaffold_learning.py [--seeds 0,1,2] [--steps 20] [--warmup-steps 8]

Resumable by seed: each seed's result is merged into ``bench/results/scaffold_learning.json`` as it finishes, and a
seed already there is skipped (``--again`` reruns it). Last line: one JSON object: per seed the held-out accuracy
before and after RL, its gain and wall time; the mean gain over the seeds, the pooled paired 95% interval
(``bench/scenario_stats.py``), the t interval of the seeds' gains, solved counts by question kind and the
zero-shot accuracy, and the shuffled-reward control's change (seed 0, the same run with each step's rewards
permuted; ``--no-control`` skips it). Run it alone on the machine (torch timing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scenario_stats import pooled_gain, seed_interval

RESULT = Path(__file__).parent / "results" / "scaffold_learning.json"
FULMEN = [sys.executable, "-m", "fulmen.cli.main"]


def solved_by_version(run_dir: Path, tasks: list[str]) -> dict[str, list[bool]]:
    """Per validated model version, whether each of ``tasks`` (ids, in file order) earned reward 1, from the run's
    store through ``fulmen sql``."""
    from examples.outcomes import validation_episodes

    env = {**os.environ, "FULMEN_CLICKHOUSE_PATH": str(run_dir / "chdb"), "FULMEN_CLICKHOUSE_READ_PORT": "0"}

    def sql(_: Any, query: str) -> list[dict[str, Any]]:
        done = subprocess.run([*FULMEN, "sql", "--format", "jsonl", query], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"fulmen sql failed: {done.stderr[-800:]}")
        return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]

    found: dict[str, dict[str, bool]] = {}
    for episode in validation_episodes(None, "fulmen", sql):
        found.setdefault(episode.version, {})[episode.task_id] = episode.reward >= 1.0
    return {version: [by_task.get(t, False) for t in tasks] for version, by_task in found.items()}


def one_run(
    project: Path, seed: int, steps: int, warm: bool, warmup_steps: int = 8, control: bool = False
) -> dict[str, Any]:
    """The README's command in ``project`` (or, ``warm`` False, the base model validated once; ``control``: with
    each step's rewards shuffled); its outcomes."""
    import fulmen
    from fulmen.schemas.task_file import load_task_file

    os.chdir(project)
    sys.path.insert(0, str(project))
    warmup = {"warmup_teacher": "teacher:teach", "warmup_steps": warmup_steps} if warm else {}
    started = time.perf_counter()
    report = fulmen.train(
        "agent:run",
        "train.jsonl",
        "smollm2",
        val="val.jsonl",
        steps=steps,
        run=f"bench-{'control' if control else 'rl' if warm else 'zero-shot'}-{seed}-{time.strftime('%Y%m%d-%H%M%S')}",
        seed=seed,
        keep_checkpoints=2,  # as the README says: 20 full-weight versions would be 11 GB
        shuffle_rewards=control,
        **warmup,
    )
    wall = time.perf_counter() - started
    tasks = [task.task_id for task in load_task_file(project / "val.jsonl")]
    by_version = solved_by_version(report.run_dir, tasks)
    versions = sorted(by_version, key=int)
    return {
        "wall_s": round(wall, 1),
        "s_per_step": round(wall / steps, 1) if steps else None,
        "versions": versions,
        "solved": {v: by_version[v] for v in (versions[0], versions[-1])},
        "reward_curve": report.reward_curve,
    }


def run_seed(seed: int, steps: int, home: Path, warmup_steps: int, control: bool = False) -> dict[str, Any]:
    from fulmen.cli.init import scaffold

    project = Path(tempfile.mkdtemp(prefix=f"scaffold-{seed}-")) / "my_agent"
    scaffold(project)
    os.environ["FULMEN_HOME"] = str(home)
    result = one_run(project, seed, steps, warm=True, warmup_steps=warmup_steps, control=control)
    result["settings"] = {"steps": steps, "warmup_steps": warmup_steps, "shuffle_rewards": control}
    before, after = result["solved"][result["versions"][0]], result["solved"][result["versions"][-1]]
    result["heldout_before"] = round(sum(before) / len(before), 4)
    result["heldout_after"] = round(sum(after) / len(after), 4)
    result["gain"] = round(result["heldout_after"] - result["heldout_before"], 4)
    return result


def zero_shot(home: Path) -> float:
    from fulmen.cli.init import scaffold

    project = Path(tempfile.mkdtemp(prefix="scaffold-zero-")) / "my_agent"
    scaffold(project)
    os.environ["FULMEN_HOME"] = str(home)
    solved = next(iter(one_run(project, 0, 0, warm=False)["solved"].values()))
    return round(sum(solved) / len(solved), 4)


def _before_after(run: dict[str, Any]) -> tuple[list[bool], list[bool]]:
    return run["solved"][run["versions"][0]], run["solved"][run["versions"][-1]]


KINDS = ("largest", "larger", "smallest", "after", "before")  # the question kinds of the scaffold's tasks.py


def kind_of(question: str) -> str:
    return next((kind for kind in KINDS if re.search(rf"\b{kind}\b", question)), "other")


def by_kind(runs: list[tuple[list[bool], list[bool]]]) -> dict[str, str]:
    """Per question kind of the scaffold's held-out file, solved before -> after, summed over the seeds."""
    from fulmen.cli.init import scaffold

    project = Path(tempfile.mkdtemp(prefix="scaffold-kinds-")) / "p"
    scaffold(project)
    kinds = [kind_of(json.loads(line)["question"]) for line in (project / "val.jsonl").read_text().splitlines()]
    table = {}
    for kind in KINDS:
        rows = [i for i, k in enumerate(kinds) if k == kind]
        before = sum(b[i] for b, _ in runs for i in rows)
        after = sum(a[i] for _, a in runs for i in rows)
        table[kind] = f"{before}/{len(rows) * len(runs)} -> {after}/{len(rows) * len(runs)}"
    return table


def summary(seeds: dict[str, Any], zero: float | None, control: dict[str, Any] | None = None) -> dict[str, Any]:
    runs = [_before_after(r) for r in seeds.values()]
    pooled = pooled_gain(runs) if runs else {}
    gains = [r["gain"] for r in seeds.values()]
    return {
        "seeds": sorted(seeds, key=int),
        "heldout_before": round(sum(r["heldout_before"] for r in seeds.values()) / len(seeds), 4) if seeds else None,
        "heldout_after": round(sum(r["heldout_after"] for r in seeds.values()) / len(seeds), 4) if seeds else None,
        "gain_by_seed": gains,
        "heldout_ci95": pooled.get("ci95"),
        "seed_ci95": seed_interval(gains),
        "heldout_n": pooled.get("n"),
        "zero_shot": zero,
        "control_delta": control["gain"] if control else None,
        "control_ci95": pooled_gain([_before_after(control)]).get("ci95") if control else None,
        "by_kind": by_kind(runs) if runs else {},
        "wall_s_by_seed": [r["wall_s"] for r in seeds.values()],
        "s_per_step": [r["s_per_step"] for r in seeds.values()],
        "model": "SmolLM2-135M-Instruct",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup-steps", type=int, default=8)
    parser.add_argument("--home", type=Path, default=Path.home() / ".cache" / "fulmen" / "bench-scaffold")
    parser.add_argument("--again", action="store_true", help="rerun seeds already in the result file")
    parser.add_argument("--no-zero-shot", action="store_true")
    parser.add_argument("--no-control", action="store_true", help="skip the shuffled-reward control run (seed 0)")
    args = parser.parse_args()
    saved = json.loads(RESULT.read_text()) if RESULT.is_file() else {}
    seeds: dict[str, Any] = saved.get("by_seed", {})
    zero, control = saved.get("zero_shot"), saved.get("control")
    for seed in (int(s) for s in args.seeds.split(",") if s.strip()):
        if str(seed) in seeds and not args.again:
            continue
        seeds[str(seed)] = run_seed(seed, args.steps, args.home, args.warmup_steps)
        RESULT.write_text(json.dumps({**summary(seeds, zero, control), "by_seed": seeds, "control": control}) + "\n")
    if zero is None and not args.no_zero_shot:
        zero = zero_shot(args.home)
    if control is None and not args.no_control:
        control = run_seed(0, args.steps, args.home, args.warmup_steps, control=True)
    result = {**summary(seeds, zero, control), "by_seed": seeds, "control": control}
    RESULT.write_text(json.dumps(result) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("by_seed", "control")} | {"result": str(RESULT)}))


if __name__ == "__main__":
    main()
