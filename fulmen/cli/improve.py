"""``fulmen improve``: rounds of training on what the store gathered since the last round, each version promoted
only when it beats the serving one (:mod:`fulmen.algorithm.service.improve`)."""

from __future__ import annotations

import asyncio
import re
import signal
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from fulmen.algorithm.settings import TrainSettings
from fulmen.cli.base import console, friendly, load_settings
from fulmen.cli.settings_options import with_options
from fulmen.cli.train import TRAIN_OPTIONS
from fulmen.schemas.errors import FulmenError

__all__ = ["improve_command", "seconds"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def seconds(text: str, option: str) -> float:
    """A duration as the options take it: ``90``, ``90s``, ``10m``, ``1.5h``."""
    found = _DURATION.match(text)
    if found is None:
        raise FulmenError(f"{option} {text!r}: give a duration such as 90s, 10m or 1h")
    return float(found.group(1)) * _UNIT_S[found.group(2)]


@with_options(TRAIN_OPTIONS)
@friendly
def improve_command(
    val: Annotated[Path, typer.Option(help="JSONL of held-out tasks every version is judged on")],
    every: Annotated[str, typer.Option(help="how often a round starts: 90s, 10m, 1h")] = "10m",
    rounds: Annotated[int, typer.Option(help="stop after this many rounds (0: until stopped)", min=0)] = 0,
    settle: Annotated[
        str, typer.Option(help="leave out rollouts that ended more recently than this (their feedback may come)")
    ] = "60s",
    steps_per_round: Annotated[
        int, typer.Option(help="at most this many steps a round (0: one pass over its window's groups)", min=0)
    ] = 0,
    since: Annotated[
        str, typer.Option(help="the first round's window starts here (ISO 8601, UTC); default: everything stored")
    ] = "",
    dataset: Annotated[
        Path | None, typer.Option(help="JSONL of tasks to run besides the replayed ones (--replay-fraction)")
    ] = None,
    train_from: Annotated[
        str,
        typer.Option(
            help="serving: each round trains from the version that serves (refused versions are not trained "
            "further); latest: from the run's latest version"
        ),
    ] = "serving",
    **options: Any,
) -> None:
    """Improve the serving model from what agents did: every --every, train on the rollouts the --replay SELECT
    picks among those stored since the last round (production episodes with their late feedback, or runner
    rollouts), judge each new version on --val against the version that serves (a paired test: --promote-margin,
    --promote-confidence) and promote it only if it is better. Gateways started with FULMEN_LLM_FOLLOW=promoted
    serve what is promoted. Needs the deployment running (`fulmen up`, a runner of the agent for the held-out
    tasks). Killed and run again with the same --run, it finishes the round it was in: nothing is trained twice."""
    settings = load_settings(TrainSettings, service=True, overrides=TRAIN_OPTIONS.overrides(options))
    if not settings.train.replay_sql:
        raise FulmenError('what should each round train on? pass --replay "SELECT RolloutId FROM fulmen.rollouts ..."')
    from fulmen.algorithm.service.improve import ImprovePlan

    if train_from not in ("serving", "latest"):
        raise FulmenError(f"--train-from {train_from!r}: give serving or latest")
    start = datetime.fromisoformat(since).replace(tzinfo=UTC) if since else ImprovePlan.since
    plan = ImprovePlan(
        every_s=seconds(every, "--every"),
        rounds=rounds,
        settle_s=seconds(settle, "--settle"),
        steps_per_round=steps_per_round,
        since=start,
        train_from=train_from,  # type: ignore[arg-type]  # checked above
    )
    _improve(settings, plan, val, dataset)


def _improve(settings: Any, plan: Any, val: Path, dataset: Path | None) -> None:
    from fulmen.algorithm.service.improve import Round, improve
    from fulmen.infra.memory import limit_malloc_arenas
    from fulmen.infra.services import ensure_kafka
    from fulmen.schemas.task_file import load_task_file

    val_tasks, tasks = load_task_file(val), load_task_file(dataset) if dataset else None
    limit_malloc_arenas()  # rounds of steps on worker threads: bounded memory (fulmen.infra.memory)
    ensure_kafka(settings)

    def said(done: Round) -> None:
        decided = f"promoted {done.promoted or 'none'}, rejected {done.rejected or 'none'}"
        serving = "the model it started with" if done.serving_version is None else f"version {done.serving_version}"
        console.print(
            f"round {done.number}: {done.selected} rollout(s) selected, {done.groups} group(s), steps "
            f"{done.steps_from + 1}-{done.steps_to}; {decided}; serving: {serving}"
            if done.steps_to > done.steps_from
            else f"round {done.number}: nothing new to train on in [{done.since}, {done.until})"
        )

    async def main() -> list[Round]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await improve(settings, plan, val_tasks, stop, tasks=tasks, on_round=said)

    done = asyncio.run(main())
    console.print(
        f"run {settings.train.run_id}: {len(done)} round(s); the rounds are in {settings.run_dir}/improve.json"
    )
