"""``fulmen improve``: the improvement loop as one command, against a deployment that already runs (``fulmen up``).

Every ``every`` seconds a round:

1. takes its window: the rollouts whose row in the store was last written (``rollouts.Timestamp``: the episode's
   end, or its latest attempt's) from where the last round's window ended up to ``settle`` seconds ago, so that
   feedback arriving a little after an episode ended is there when it is trained on;
2. selects among them what the user's SELECT selects (``--replay``): ``SELECT RolloutId FROM (<theirs>) WHERE
   RolloutId IN (<the window's rollouts>)`` (:func:`round_selection`), read through the store's read-only reader;
3. trains on them as more steps of one run (``--run``): one pass over the window's groups, ``groups_per_step`` a
   step (:func:`round_steps`; ``steps_per_round`` caps the steps, each then taking more), numbered after the run's
   latest version, from the weights of the version that serves (``train_from = serving``, the default: a version
   the gate refused is not trained further, so refusals cannot pile up into a drift) or from the latest version
   (``latest``: the run's optimizer state goes on too);
4. validates every version on the held-out tasks and promotes it only when it beats the serving version by the
   paired test (:mod:`~fulmen.algorithm.service.promotion`): the gateways that follow promotions
   (``FULMEN_LLM_FOLLOW=promoted``) swap to it without failing a call; a round that promotes nothing leaves the
   serving version as it was. A round with nothing trainable in its window trains nothing and says so.

Restarts: the rounds are kept in ``<run_dir>/improve.json`` (:class:`RoundBook`), each written before it trains
(its window and the step it trains up to) and marked done after. Run again after a kill, the command first
finishes the round it was in, with the same window, from the run's latest checkpoint and past the groups already
trained on (the replay position saved with each checkpoint): nothing is trained twice, nothing is skipped. An
episode that ends again after its round (a production trace that got another call) is in a later window, with all
its calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

from fulmen.algorithm.service.checkpoints import checkpoint_dir
from fulmen.algorithm.service.dispatcher import DatasetTask
from fulmen.algorithm.service.reporting import read_metrics
from fulmen.algorithm.service.run import (
    latest_checkpoint,
    load_replay_buffer,
    promotion_gate,
    resolve_model,
    run_trainer,
)
from fulmen.algorithm.settings import TrainSettings
from fulmen.infra.memory import release_free_memory
from fulmen.schemas.ddl import TABLES
from fulmen.schemas.errors import ConfigurationError

__all__ = ["ImprovePlan", "Round", "RoundBook", "improve", "round_selection", "round_steps"]

log = logging.getLogger(__name__)

BOOK = "improve.json"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class ImprovePlan:
    """How often rounds run and what each takes (the command's options)."""

    every_s: float = 600.0
    rounds: int = 0  # 0: until stopped
    settle_s: float = 60.0
    steps_per_round: int = 0  # 0: one pass over the window's groups
    since: datetime = EPOCH  # where the first round's window starts
    train_from: Literal["serving", "latest"] = "serving"  # the weights a round starts from


@dataclass
class Round:
    """One round: its window of rollouts, the step the run reaches, and what it decided."""

    number: int
    since: str  # ISO 8601, UTC, microseconds: rollouts with since <= Timestamp < until
    until: str
    steps_from: int  # the run's step when the round started
    steps_to: int = -1  # the run's step when the round's training ends (-1: not planned yet)
    groups_per_step: int = 0  # the round's: its groups spread evenly over its steps
    selected: int = 0  # rollouts the selection returned
    groups: int = 0  # trainable groups among them
    done: bool = False
    promoted: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    serving_version: int | None = None
    serving_score: float | None = None
    started_at: float = 0.0
    ended_at: float = 0.0


class RoundBook:
    """The rounds of one run, in ``<run_dir>/improve.json`` (written whole, through a rename, at each change)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / BOOK
        data = json.loads(self.path.read_text()) if self.path.is_file() else {"rounds": []}
        self.rounds = [Round(**r) for r in data["rounds"]]

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.path.with_suffix(".json.tmp")
        staging.write_text(json.dumps({"rounds": [asdict(r) for r in self.rounds]}, indent=1) + "\n")
        staging.replace(self.path)

    @property
    def unfinished(self) -> Round | None:
        return next((r for r in self.rounds if not r.done), None)

    def next_round(self, plan: ImprovePlan, now: datetime, steps: int) -> Round:
        """A new round whose window starts where the last one's ended (the first: ``plan.since``)."""
        since = self.rounds[-1].until if self.rounds else _iso(plan.since)
        until = _iso(max(now - timedelta(seconds=plan.settle_s), datetime.fromisoformat(since)))
        started = Round(len(self.rounds) + 1, since, until, steps_from=steps, started_at=time.time())
        self.rounds.append(started)
        self.save()
        return started


def round_selection(user_sql: str, database: str, since: str, until: str) -> str:
    """The user's selection restricted to the rollouts of one window (their rows' Timestamp in [since, until))."""
    table = f"{database}.{TABLES['rollouts']}" if database else TABLES["rollouts"]
    window = (
        f"SELECT RolloutId FROM {table} FINAL WHERE Timestamp >= toDateTime64('{_sql_time(since)}', 6, 'UTC') "
        f"AND Timestamp < toDateTime64('{_sql_time(until)}', 6, 'UTC')"
    )
    return f"SELECT RolloutId FROM ({user_sql.strip().rstrip(';')}) WHERE RolloutId IN ({window})"


async def improve(
    settings: TrainSettings,
    plan: ImprovePlan,
    val_tasks: list[DatasetTask],
    stop: asyncio.Event,
    *,
    tasks: list[DatasetTask] | None = None,
    clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    on_round: Callable[[Round], None] = lambda _: None,
) -> list[Round]:
    """Run rounds (module docstring) until ``plan.rounds`` are done or ``stop`` is set; the rounds of this call."""
    options = settings.train
    if not options.replay_sql:
        raise ConfigurationError('what should each round train on? pass --replay "SELECT RolloutId FROM ..."')
    if not val_tasks:
        raise ConfigurationError("each round judges its versions on held-out tasks: pass --val FILE")
    book = RoundBook(settings.run_dir)
    done: list[Round] = []
    while not stop.is_set() and (plan.rounds == 0 or len([r for r in book.rounds if r.done]) < plan.rounds):
        current = book.unfinished or book.next_round(plan, clock(), _steps_done(settings.run_dir))
        await _run_round(settings, plan, book, current, val_tasks, tasks or [], stop)
        gc.collect()  # the round's trainer (model, optimizer) goes before the next round builds its own
        release_free_memory()
        if not current.done:
            break  # stopped mid-round: the next run of the command finishes it
        done.append(current)
        on_round(current)
        if plan.rounds and len([r for r in book.rounds if r.done]) >= plan.rounds:
            break
        wait = current.started_at + plan.every_s - time.time()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=max(wait, 0.0))
    return done


async def _run_round(
    settings: TrainSettings,
    plan: ImprovePlan,
    book: RoundBook,
    current: Round,
    val_tasks: list[DatasetTask],
    tasks: list[DatasetTask],
    stop: asyncio.Event,
) -> None:
    """Train, validate and decide one round; marks it done unless ``stop`` ended it first."""
    selection = round_selection(settings.train.replay_sql, _database(settings), current.since, current.until)
    round_settings = settings.model_copy(deep=True)
    round_settings.train.replay_sql = selection
    round_settings.train.promote_if_better = True
    run_dir = settings.run_dir
    base_model = await asyncio.to_thread(resolve_model, settings.train.model_path, run_dir)
    buffer = await asyncio.to_thread(load_replay_buffer, round_settings, base_model, allow_empty=True)
    current.selected, current.groups = buffer.selected, len(buffer.groups)
    if current.steps_to < 0:  # planned once: a rerun after a kill trains up to the same step
        steps, current.groups_per_step = round_steps(len(buffer.groups), settings.train.groups_per_step, plan)
        current.steps_to = current.steps_from + steps
        book.save()
    round_settings.train.groups_per_step = max(current.groups_per_step, 1)
    log.info(
        "round %d: rollouts of [%s, %s): %s; training steps %d to %d",
        current.number,
        current.since,
        current.until,
        buffer.summary(),
        current.steps_from + 1,
        current.steps_to,
    )
    if current.steps_to > _steps_done(run_dir):
        round_settings.train.steps = current.steps_to
        weights = await _round_weights(round_settings, plan, current, base_model)
        replay = buffer if buffer.groups else None
        await run_trainer(round_settings, tasks, val_tasks, stop, replay=replay, weights_from=weights)
    if _steps_done(run_dir) < current.steps_to:
        return
    _record_decisions(current, run_dir)
    current.done, current.ended_at = True, time.time()
    book.save()


async def _round_weights(settings: TrainSettings, plan: ImprovePlan, current: Round, base_model: str) -> Path | None:
    """The weights a round trains from when they are not the run's latest version: the serving version's, so that
    versions the gate refused are not trained further (``plan.train_from = serving``); None: the latest (the
    round already trained some of its steps, the latest serves, or the serving version is not one of this run's)."""
    done = _steps_done(settings.run_dir)
    if plan.train_from != "serving" or done == 0 or done != current.steps_from:
        return None
    serving = (await promotion_gate(settings, done)).serving
    if serving.run_id != settings.train.run_id or serving.version == done:
        return None
    weights = Path(base_model) if serving.version == 0 else checkpoint_dir(settings.run_dir, serving.version)
    if not weights.is_dir():
        log.warning(
            "round %d: the serving version's weights (%s) are gone: it trains on from the latest",
            current.number,
            weights,
        )
        return None
    log.info(
        "round %d: versions %d-%d were not promoted; it trains from the serving version %d",
        current.number,
        serving.version + 1,
        done,
        serving.version,
    )
    return weights


def round_steps(groups: int, groups_per_step: int, plan: ImprovePlan) -> tuple[int, int]:
    """A round's steps and groups a step: one pass over its ``groups``, ``groups_per_step`` a step (at most
    ``plan.steps_per_round`` steps, each then taking more), spread evenly; when they do not divide evenly, the last
    step fills up with the round's first groups (fewer than one a step)."""
    if groups == 0:
        return 0, 0
    steps = math.ceil(groups / max(groups_per_step, 1))
    if plan.steps_per_round:
        steps = min(steps, plan.steps_per_round)
    return steps, math.ceil(groups / steps)


def _record_decisions(current: Round, run_dir: Path) -> None:
    """The round's promotions and rejections, and what serves after it, from the run's metrics (every step of the
    round, those trained before a restart too)."""
    rows = [
        r for r in read_metrics(run_dir / "metrics.jsonl") if current.steps_from < int(r["step"]) <= current.steps_to
    ]
    current.promoted = [int(r["step"]) for r in rows if r.get("extra/promoted") == 1.0]
    current.rejected = [int(r["step"]) for r in rows if r.get("extra/promoted") == 0.0]
    if rows and "extra/serving_version" in rows[-1]:
        current.serving_version = int(rows[-1]["extra/serving_version"])
        current.serving_score = rows[-1].get("extra/serving_score")


def _steps_done(run_dir: Path) -> int:
    """The run's last checkpointed step (0: none yet)."""
    latest = latest_checkpoint(run_dir)
    return latest[0] if latest is not None else 0


def _database(settings: TrainSettings) -> str:
    from fulmen.algorithm.service.run import source_store_settings

    return source_store_settings(settings, settings.train.source_store).clickhouse.database


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="microseconds")


def _sql_time(iso: str) -> str:
    """An ISO time as ClickHouse's DateTime64 literal reads it (no offset: the column is UTC)."""
    return datetime.fromisoformat(iso).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
