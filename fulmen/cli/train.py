"""``fulmen train``: the command (registered by ``fulmen.cli.main``), in one process, under torchrun, or ``--local``
with the stack it needs."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from fulmen.cli.base import console, err, friendly, load_settings
from fulmen.infra.errors import FulmenError

__all__ = ["train_command"]


@friendly
def train_command(
    dataset: Annotated[Path | None, typer.Option(help="JSONL of training tasks, one per line")] = None,
    model: Annotated[str | None, typer.Option(help="base model directory, or 'tiny' (FULMEN_TRAIN_MODEL_PATH)")] = None,
    agent: Annotated[
        str | None, typer.Option(help="module:function the runners run, recorded in requests (FULMEN_TRAIN_AGENT)")
    ] = None,
    val: Annotated[Path | None, typer.Option(help="JSONL of validation tasks")] = None,
    steps: Annotated[int | None, typer.Option(help="optimisation steps (FULMEN_TRAIN_STEPS)")] = None,
    nproc: Annotated[
        int | None, typer.Option(help="training ranks on this machine, FSDP2 under torchrun (FULMEN_TRAIN_NPROC)")
    ] = None,
    local: Annotated[
        bool, typer.Option("--local", help="start Kafka, consume, both gateways and the runners for this run")
    ] = False,
    runners: Annotated[int, typer.Option(help="--local: runner processes of the agent", min=1)] = 1,
    concurrency: Annotated[int, typer.Option(help="--local: rollouts at once per runner", min=1)] = 32,
    replay: Annotated[
        str | None,
        typer.Option(
            help="train on the stored rollouts this SELECT returns (rollout ids), with no new rollouts of "
            "them (FULMEN_TRAIN_REPLAY_SQL)"
        ),
    ] = None,
    replay_fraction: Annotated[
        float | None,
        typer.Option(
            help="with --dataset too: the share of each step's groups replayed (FULMEN_TRAIN_REPLAY_FRACTION)",
            min=0,
            max=1,
        ),
    ] = None,
    source_store: Annotated[
        str | None,
        typer.Option(
            help="where --replay and --tasks-sql read: an embedded store's directory or a ClickHouse URL "
            "(default: this deployment's; FULMEN_TRAIN_SOURCE_STORE)"
        ),
    ] = None,
    tasks_sql: Annotated[
        str | None,
        typer.Option(
            help="dispatch the stored tasks this SELECT returns (task ids; their payloads from the tasks "
            "table) (FULMEN_TRAIN_TASKS_SQL)"
        ),
    ] = None,
    promote_if_better: Annotated[
        bool,
        typer.Option(
            "--promote-if-better",
            help="validate each version; promote it only when its held-out accuracy "
            "is at least the serving one's minus --promote-tolerance (FULMEN_TRAIN_PROMOTE_IF_BETTER)",
        ),
    ] = False,
    promote_tolerance: Annotated[
        float | None, typer.Option(help="FULMEN_TRAIN_PROMOTE_TOLERANCE", min=0, max=1)
    ] = None,
    max_staleness: Annotated[
        int | None,
        typer.Option(help="train on calls at most this many versions old (FULMEN_TRAIN_MAX_STALENESS)", min=0),
    ] = None,
    prompt_bundle: Annotated[
        str | None,
        typer.Option(
            help="every rollout names this prompt bundle (pb-...): GRPO on its rollouts; --local publishes it "
            "from --source-store (or the store in force) (FULMEN_TRAIN_PROMPT_BUNDLE)"
        ),
    ] = None,
) -> None:
    """Train with GRPO on rollouts of the dataset: dispatch tasks, collect transitions, update, publish versions.

    Needs only Kafka; runners (`fulmen runner`), `fulmen consume` and `fulmen llm-gateway` run separately, unless
    --local: then this run starts them (and Kafka if none runs), trains, stops them, and prints the report. With
    --replay it trains on stored rollouts instead (or besides, --replay-fraction), with no agent run for them; with
    --tasks-sql its tasks are stored ones a SELECT names. With
    --nproc N (N > 1) it runs itself under torchrun: rank 0 does this, the other ranks train their shards.
    Started by torchrun (RANK, WORLD_SIZE... set), it runs as that rank."""
    import os

    from fulmen.algorithm.settings import TrainSettings
    from fulmen.algorithm.trainer import distributed

    settings = load_settings(TrainSettings, service=True)
    overrides = {
        "model_path": model,
        "agent": agent,
        "steps": steps,
        "nproc": nproc,
        "replay_sql": replay,
        "replay_fraction": replay_fraction,
        "source_store": source_store,
        "tasks_sql": tasks_sql,
        "max_staleness": max_staleness,
        "promote_if_better": promote_if_better or None,
        "promote_tolerance": promote_tolerance,
        "prompt_bundle": prompt_bundle,
    }
    for name, value in overrides.items():
        if value is not None:
            setattr(settings.train, name, value)
    settings = TrainSettings.model_validate(settings.model_dump())  # re-check what the options changed
    if dataset is None and not settings.train.replay_sql and not settings.train.tasks_sql:
        raise FulmenError(
            "what to train on? pass --dataset FILE or --tasks-sql SQL (tasks to run), or --replay SQL (stored rollouts)"
        )
    if local:
        _train_locally(settings, dataset, val, runners, concurrency)
        return
    if distributed.launched() and distributed.rank() != 0:
        distributed.serve(distributed.join(settings.train.device, settings.train.dist_timeout_s))
        return
    if not distributed.launched() and settings.train.nproc > 1:
        options = {
            "--dataset": dataset,
            "--model": model,
            "--agent": agent,
            "--val": val,
            "--steps": steps,
            "--replay": replay,
            "--replay-fraction": replay_fraction,
            "--source-store": source_store,
            "--tasks-sql": tasks_sql,
            "--max-staleness": max_staleness,
            "--promote-tolerance": promote_tolerance,
            "--prompt-bundle": prompt_bundle,
        }
        args = [str(part) for name, value in options.items() if value is not None for part in (name, value)]
        args += ["--promote-if-better"] if promote_if_better else []
        command = distributed.relaunch_command(settings.train.nproc, ["-m", "fulmen.cli.main", "train", *args])
        os.environ["FULMEN_TRAIN_RUN_ID"] = settings.train.run_id  # one run id for every rank (the default is random)
        err.print(f"run {settings.train.run_id}: training on {settings.train.nproc} ranks: {' '.join(command)}")
        os.execv(command[0], command)
    _train_here(settings, dataset, val)


def _train_locally(settings: Any, dataset: Path | None, val: Path | None, runners: int, concurrency: int) -> None:
    """``fulmen train --local``: :func:`fulmen.train` (the stack and the runners for this run), then its report."""
    from fulmen.training import train as train_here

    if not settings.train.agent:
        raise FulmenError("--local runs the agent: pass --agent package.module:function (or FULMEN_TRAIN_AGENT)")
    if settings.train.nproc > 1:
        raise FulmenError("--local trains in one process: drop --nproc (or FULMEN_TRAIN_NPROC)")

    def on_step(event: Any) -> None:
        held_out = event.extra.get("val_accuracy")
        shown = f", held-out accuracy {held_out:.3f}" if held_out is not None else ""
        console.print(f"step {event.step}: reward {event.reward_mean:.3f}, loss {event.loss:.4f}{shown}")

    report = train_here(
        settings.train.agent,
        dataset,
        settings.train.model_path or "tiny",
        val=val,
        runners=runners,
        concurrency=concurrency,
        settings=settings,
        on_step=on_step,
        on_phase=lambda text: console.print(f"[green]•[/] {text}"),
    )
    _print_train_report(report)


def _print_train_report(report: Any) -> None:
    accuracy = dict(report.val_accuracy_curve)
    table = Table("step", "reward", "loss", "held-out accuracy")
    if 0 in accuracy:
        table.add_row("0 (before)", "-", "-", f"{accuracy[0]:.3f}")
    for (step, reward), (_, loss) in zip(report.reward_curve, report.loss_curve, strict=True):
        table.add_row(str(step), f"{reward:.3f}", f"{loss:.4f}", f"{accuracy[step]:.3f}" if step in accuracy else "-")
    console.print(table)
    # soft_wrap: the terminal wraps a long path, Rich would break it with a newline (copied back, it is two halves)
    console.print(
        f"run {report.run_id}: {report.steps} step(s) in {report.wall_s:.0f}s; run dir {report.run_dir}",
        soft_wrap=True,
        highlight=False,
    )
    console.print(f"final model: {report.final_model or '- (no step trained)'}", soft_wrap=True, highlight=False)


def _train_here(settings: Any, dataset: Path | None, val: Path | None) -> None:
    """``fulmen train`` in this process: one process, or rank 0 of a torchrun job."""
    from fulmen.algorithm.train import train as run_training
    from fulmen.infra.services import ensure_kafka
    from fulmen.schemas.task_file import load_task_file

    tasks, val_tasks = load_task_file(dataset) if dataset else [], load_task_file(val) if val else None
    ensure_kafka(settings)
    if settings.train.prompt_bundle:
        _check_bundle(settings, settings.train.prompt_bundle)

    async def main() -> list[Any]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            return await run_training(settings, tasks, val_tasks, stop)
        finally:
            # the run is over: closing the loop would put SIGTERM back to its default action, and torchrun's SIGTERM
            # (it stops every rank once one died) would then kill this process before it says why the run ended
            loop.remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    done = asyncio.run(main())
    console.print(f"run {settings.train.run_id}: {len(done)} step(s) trained; checkpoints in {settings.run_dir}")


def _check_bundle(settings: Any, bundle_id: str) -> None:
    """--prompt-bundle against a deployment: the bundle must be on its prompts topic (else every rollout would be
    refused by the LLM gateway)."""
    from fulmen.infra.kafka.prompts import read_bundles

    if bundle_id not in asyncio.run(read_bundles(settings)):
        raise FulmenError(
            f"--prompt-bundle {bundle_id}: not on this deployment's prompts topic (`fulmen prompts "
            "list`); publish it first (`fulmen prompts create`), or train with --local and "
            "--source-store <the store that holds it>"
        )
