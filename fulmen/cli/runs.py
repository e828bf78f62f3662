"""``fulmen runs list | show RUN``: the training runs under ``$FULMEN_HOME/runs``, read from their directories (the
checkpoints, ``metrics.jsonl`` and ``train_settings.json`` every run writes; :mod:`fulmen.algorithm.service.reporting`).

A run is named by ``fulmen train --run NAME`` (or gets a new id); the same command with the same name resumes it
from its latest checkpoint, and a finished one continues only with more ``--steps``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from fulmen.cli.base import UtcOption, WideOption, console, friendly, load_settings
from fulmen.schemas.errors import FulmenError

__all__ = ["run_summary", "runs_app"]

runs_app = typer.Typer(no_args_is_help=True, help="Training runs on this machine: their steps, checkpoints, curves.")


def run_summary(run_dir: Path) -> dict[str, Any]:
    """What a run directory says of its run: steps done and asked for, the latest checkpoint, the last reward and
    held-out accuracy, the state (finished, stopped, no step yet) and when it last wrote."""
    from fulmen.algorithm.service.reporting import SETTINGS_FILE, read_metrics
    from fulmen.algorithm.service.run import latest_checkpoint

    rows = read_metrics(run_dir / "metrics.jsonl")
    settings_file = run_dir / SETTINGS_FILE
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    latest = latest_checkpoint(run_dir) if (run_dir / "checkpoints").is_dir() else None
    asked = settings.get("steps")
    done = latest[0] if latest else 0
    state = "no step yet" if not done else "finished" if asked and done >= asked else "stopped (resumable)"
    held_out = [row["extra/val_accuracy"] for row in rows if "extra/val_accuracy" in row]
    written = max((p.stat().st_mtime for p in run_dir.iterdir()), default=run_dir.stat().st_mtime)
    return {
        "run": run_dir.name,
        "state": state,
        "steps": f"{done}/{asked}" if asked else str(done),
        "reward": round(rows[-1]["train/reward_mean"], 3) if rows else None,
        "held_out": round(held_out[-1], 3) if held_out else None,
        "model": settings.get("model_path") or "",
        "updated": datetime.fromtimestamp(written, UTC),
        "latest": latest[1] if latest else None,
        "rows": rows,
    }


@runs_app.command("list")
@friendly
def runs_list(wide: WideOption = False, utc: UtcOption = False) -> None:
    """Every run under FULMEN_HOME/runs, the latest first: its state, steps done of those asked for, the last
    reward and held-out accuracy, the model, when it last wrote."""
    from fulmen.cli.render import render, table_style
    from fulmen.infra.settings import CliProcessSettings
    from fulmen.infra.store import QueryResult

    settings = load_settings(CliProcessSettings)
    runs = [p for p in (settings.home / "runs").glob("*") if p.is_dir()]
    if not runs:
        console.print(f"no runs in {settings.home / 'runs'}: `fulmen train --local --run NAME ...` starts one")
        return
    summaries = sorted((run_summary(p) for p in runs), key=lambda s: s["updated"], reverse=True)
    columns = ["run", "state", "steps", "reward", "held_out", "model", "updated"]
    result = QueryResult(columns, [[s[c] for c in columns] for s in summaries])
    render(result, "table", console, table_style(settings.cli, wide=wide, utc=utc))


@runs_app.command("show")
@friendly
def runs_show(
    run: Annotated[str, typer.Argument(help="the run's name (its directory under FULMEN_HOME/runs)")],
) -> None:
    """One run: each step's reward, loss and held-out accuracy, its files (curves.png, TensorBoard, the latest
    checkpoint), and the commands that resume and export it."""
    from rich.table import Table

    from fulmen.infra.settings import CliProcessSettings

    settings = load_settings(CliProcessSettings)
    run_dir = settings.home / "runs" / run
    if not run_dir.is_dir():
        raise FulmenError(f"no run {run!r} in {settings.home / 'runs'} (`fulmen runs list` lists them)")
    summary = run_summary(run_dir)
    table = Table("step", "reward", "loss", "held-out accuracy", "entropy")
    for row in summary["rows"]:
        cells = [row.get(k) for k in ("train/reward_mean", "train/loss", "extra/val_accuracy", "extra/entropy")]
        table.add_row(str(row["step"]), *("-" if v is None else f"{v:.3f}" for v in cells))
    console.print(table)
    console.print(f"run {run}: {summary['state']}, steps {summary['steps']}", highlight=False)
    for name in ("curves.png", "tensorboard", "metrics.jsonl"):
        if (run_dir / name).exists():
            console.print(f"  {name}: {run_dir / name}", highlight=False, soft_wrap=True)
    if summary["latest"] is not None:
        console.print(f"  latest checkpoint: {summary['latest']}", highlight=False, soft_wrap=True)
        console.print(f"  export it: fulmen export {run} DIR [--gguf q8_0]", highlight=False)
    if summary["state"] != "finished" or summary["latest"] is None:
        console.print(f"  resume it: the command that started it, with --run {run}", highlight=False)
    else:
        console.print(f"  train it further: the command that started it, with --run {run} and more --steps")
