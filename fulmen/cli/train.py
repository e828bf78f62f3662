"""``fulmen train``: the command (registered by ``fulmen.cli.main``), in one process, under torchrun, or ``--local``
with the stack it needs."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from fulmen.algorithm.settings import TrainSection, TrainSettings
from fulmen.cli.base import console, err, friendly, load_settings
from fulmen.cli.settings_options import SectionOptions, with_options
from fulmen.schemas.errors import FulmenError

__all__ = ["train_command"]


# Every TrainSection field is an option of `fulmen train` (fulmen.cli.settings_options); these keep their older names.
TRAIN_OPTIONS = SectionOptions(
    TrainSection, "train", aliases={"model_path": "--model", "replay_sql": "--replay", "run_id": "--run"}
)


@with_options(TRAIN_OPTIONS)
@friendly
def train_command(
    dataset: Annotated[Path | None, typer.Option(help="JSONL of training tasks, one per line")] = None,
    val: Annotated[Path | None, typer.Option(help="JSONL of validation tasks")] = None,
    local: Annotated[
        bool, typer.Option("--local", help="start Kafka, consume, both gateways and the runners for this run")
    ] = False,
    runners: Annotated[int, typer.Option(help="--local: runner processes of the agent", min=1)] = 1,
    concurrency: Annotated[int, typer.Option(help="--local: rollouts at once per runner", min=1)] = 32,
    **options: Any,
) -> None:
    """Train with GRPO on rollouts of the dataset: dispatch tasks, collect transitions, update, publish versions.

    Needs only Kafka; runners (`fulmen runner`), `fulmen consume` and `fulmen llm-gateway` run separately, unless
    --local: then this run starts them (and Kafka if none runs), trains, stops them, and prints the report. With
    --replay it trains on stored rollouts instead (or besides, --replay-fraction), with no agent run for them; with
    --tasks-sql its tasks are stored ones a SELECT names. With
    --nproc N (N > 1) it runs itself under torchrun: rank 0 does this, the other ranks train their shards.
    Started by torchrun (RANK, WORLD_SIZE... set), it runs as that rank. Every training setting is an option
    (below); one not given comes from its FULMEN_TRAIN_* variable, .env, or its default."""
    settings = load_settings(TrainSettings, service=True, overrides=TRAIN_OPTIONS.overrides(options))
    if dataset is None and not settings.train.replay_sql and not settings.train.tasks_sql:
        raise FulmenError(
            "what to train on? pass --dataset FILE or --tasks-sql SQL (tasks to run), or --replay SQL (stored rollouts)"
        )
    from fulmen.algorithm.trainer import distributed  # torch: after the settings' checks, which answer at once

    if local:
        _train_locally(settings, dataset, val, runners, concurrency)
        return
    if not distributed.launched():  # once, before torchrun starts the ranks (they load the model it names)
        _prepare_model(settings, dataset)
    if distributed.launched() and distributed.rank() != 0:
        distributed.serve(distributed.join(settings.train.device, settings.train.dist_timeout_s))
        return
    if not distributed.launched() and settings.train.nproc > 1:
        files = (("--dataset", dataset), ("--val", val))
        args = [str(part) for name, value in files if value is not None for part in (name, value)]
        command = distributed.relaunch_command(settings.train.nproc, ["-m", "fulmen.cli.main", "train", *args])
        err.print(f"run {settings.train.run_id}: training on {settings.train.nproc} ranks: {' '.join(command)}")
        os.execve(command[0], command, relaunch_environment(settings, os.environ))
    _train_here(settings, dataset, val)


def relaunch_environment(settings: TrainSettings, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` for a relaunched rank: the whole training section of ``settings`` (options, variables, ``.env``
    and the generated run id, one for every rank) as ``FULMEN_TRAIN`` (JSON), and no ``FULMEN_TRAIN_*``, which
    would override the JSON field by field."""
    prefix = TRAIN_OPTIONS.env_prefix
    kept = {name: value for name, value in environ.items() if not name.upper().startswith(prefix)}
    return {**kept, "FULMEN_TRAIN": settings.train.model_dump_json()}


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


def _prepare_model(settings: Any, dataset: Path | None) -> None:
    """``--model smollm2`` made, and with ``--warmup-teacher`` / ``--warmup-sql`` the warm-up run (cached): the
    model the trainer loads becomes that directory."""
    from fulmen.schemas.task_file import load_task_file
    from fulmen.training import model_directory
    from fulmen.warmup import warmed_model

    train = settings.train
    warming = train.warmup_teacher or train.warmup_sql
    if train.model_path == "smollm2" or (warming and train.model_path):
        model = model_directory(train.model_path, settings.home)
        tasks = load_task_file(dataset) if dataset and train.warmup_teacher else []

        def phase(text: str) -> None:
            console.print(f"[green]•[/] {text}")

        warmed = warmed_model(train.model_dump(), train.agent, model, tasks, settings.home, phase, settings=settings)
        train.model_path = str(warmed)


def _train_here(settings: Any, dataset: Path | None, val: Path | None) -> None:
    """``fulmen train`` in this process: one process, or rank 0 of a torchrun job."""
    from fulmen.algorithm.service.run import run_trainer
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
            return await run_trainer(settings, tasks, val_tasks, stop)
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
    from fulmen.algorithm.prompts.bundles import read_bundles

    if bundle_id not in asyncio.run(read_bundles(settings)):
        raise FulmenError(
            f"--prompt-bundle {bundle_id}: not on this deployment's prompts topic (`fulmen prompts "
            "list`); publish it first (`fulmen prompts create`), or train with --local and "
            "--source-store <the store that holds it>"
        )
