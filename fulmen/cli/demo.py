"""``fulmen demo``: the rendering around :func:`fulmen.algorithm.demo.run.run_demo` (progress, report, queries)."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fulmen.infra.settings import FulmenSettings
from fulmen.schemas.errors import FulmenError

__all__ = ["run_demo_command"]


def run_demo_command(
    settings: FulmenSettings,
    console: Console,
    *,
    steps: int | None,
    shuffle_rewards: bool,
    as_json: bool,
    algorithm: str = "grpo",
    mode: str = "sync",
    stop_at_accuracy: float | None = None,
) -> dict[str, Any]:
    """Run the demo with a live progress bar, print the report; the report dict (also the JSON line)."""
    from fulmen.algorithm.demo.report import report_dict, run_queries
    from fulmen.algorithm.demo.run import DemoOptions, run_demo

    options = DemoOptions(
        shuffle_rewards=shuffle_rewards,
        algorithm=algorithm,
        mode=mode,
        stop_at_accuracy=stop_at_accuracy,
        **({"steps": steps} if steps else {}),
    )
    progress = _progress(console)
    warmup = progress.add_task("warm-up (supervised)", total=options.warmup.steps, info="", visible=False)
    task = progress.add_task("training (GRPO)", total=options.steps, info="", visible=False)
    shown = {"reward": "-", "accuracy": "-"}
    queries: list[Any] = []

    def on_phase(text: str) -> None:
        progress.console.print(f"[green]•[/] {text}")

    def on_warmup(step: int, steps: int, loss: float) -> None:
        progress.update(warmup, completed=step, visible=True, info=f"loss {loss:.3f}")

    def on_step(event: Any) -> None:
        accuracy = event.extra.get("val_accuracy")
        shown["reward"] = f"{event.reward_mean:.3f}"
        if "initial_val_accuracy" in event.extra and accuracy is None:
            shown["accuracy"] = f"{event.extra['initial_val_accuracy']:.3f} (before)"
        if accuracy is not None:
            shown["accuracy"] = f"{accuracy:.3f}"
        info = f"reward {shown['reward']}  held-out accuracy {shown['accuracy']}"
        progress.update(task, completed=event.step, visible=True, info=info)

    def after(run: Any) -> None:
        on_phase("running the SQL queries a user can run next (fulmen sql, against this run's store)")
        queries.extend(run_queries(run, settings.clickhouse.database))

    with progress:
        run = run_demo(settings, options, on_phase=on_phase, on_step=on_step, on_warmup=on_warmup, after=after)
    plot = run.run_dir / "curves.png"  # the trainer draws it when the run ends (service/reporting.py)
    plot = plot if plot.is_file() else None
    report = report_dict(run, plot, shuffle_rewards, algorithm, mode)
    _print_report(console, report, run, queries)
    if as_json:
        print(json.dumps(report))
    if report["accuracy_after"] is None:
        raise FulmenError(
            f"the demo ended without a final validation ({len(run.steps)} step(s)); logs in {run.run_dir / 'logs'}"
        )
    return report


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def _print_report(console: Console, report: dict[str, Any], run: Any, queries: list[Any]) -> None:
    before, after = report["accuracy_before"], report["accuracy_after"]
    control = " (CONTROL: rewards shuffled within each step)" if report["shuffle_rewards"] else ""
    console.print(
        f"\n[bold]held-out accuracy{control}:[/] {_pct(before)} before -> [bold]{_pct(after)}[/] after "
        f"{report['steps']} GRPO steps"
    )
    console.print(
        f"wall {report['wall_s']}s (warm-up {report['warmup_s']}s, start-up {report['startup_s']}s, "
        f"training {report['train_s']}s; per step: waiting for rollouts {report['mean_rollout_wait_s']}s, "
        f"update {report['mean_update_s']}s)"
    )
    if report["plot"]:
        console.print(f"curves: {report['plot']}")
    console.print(f"final model: {report['final_model']} (a Hugging Face directory)")
    env = " ".join(f"{k}={v}" for k, v in run.env.items() if k in ("FULMEN_CLICKHOUSE_PATH",))
    console.print(f'\n[bold]The stored data, with SQL[/] (later: [dim]{env} fulmen sql "..."[/])')
    for result in queries:
        console.print(f'\n[bold]{result.title}[/]  [dim]fulmen sql "{result.sql}"[/]', soft_wrap=True)
        console.print(result.output, highlight=False, markup=False)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"
