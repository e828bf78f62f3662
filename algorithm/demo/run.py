"""The demo's orchestration: warm up, then train through the whole system (:mod:`fulmen.algorithm.local`).

Lifecycle of :func:`run_demo`:

1. the warmed-up tiny model (``warmup``; cached under ``$FULMEN_HOME/demo-warmup`` by its plan);
2. :func:`fulmen.algorithm.local.run_locally` with the demo's agent (``fulmen.algorithm.demo.agent:solve``) on
   that model: Kafka, ``fulmen consume``, both gateways, the runners, the trainer (GRPO on the generated
   training set, greedy validation on the held-out set through the same system: that is the accuracy
   reported, nothing is evaluated outside the system), then every process stopped;
3. the report (``fulmen.cli.demo``): accuracy before/after, curves (PNG), SQL queries run once with ``fulmen sql``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fulmen.algorithm.demo.agent import CALL_TOKENS
from fulmen.algorithm.demo.tasks import heldout_tasks, train_tasks
from fulmen.algorithm.demo.warmup import WarmupPlan, warm_up
from fulmen.algorithm.local import LocalPlan, LocalRun, run_locally
from fulmen.infra.services import check_kafka_can_start
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas.events import TrainStep

__all__ = ["DemoOptions", "DemoRun", "run_demo", "train_fields"]

AGENT = "fulmen.algorithm.demo.agent:solve"
DemoRun = LocalRun  # the demo's outcome is a local run's (its warm-up time in ``warmup_s``)


@dataclass(frozen=True)
class DemoOptions:
    """What the demo runs; the defaults are the tuned ones (README: what the demo shows)."""

    steps: int = 30
    shuffle_rewards: bool = False
    algorithm: str = "grpo"  # FULMEN_TRAIN_ALGORITHM: grpo, dr_grpo, rloo, dapo, gspo, cispo
    mode: str = "sync"  # FULMEN_TRAIN_MODE: sync or async
    max_staleness: int = 1  # async: how many versions old a sample may be
    agent: str = AGENT  # module:function the runners run (a bench wraps the demo's agent)
    group_size: int = 8
    groups_per_step: int = 12  # four of each untaught wording (dispatched in order); see tasks.py
    lr: float = 1e-3
    epochs_per_batch: int = 2  # two PPO-clip passes a step: learning started ~twice as early (README)
    kl_coef: float = 0.1  # without it, lr 1e-3 lost the tool-call format at step 13 of 60 (never recovered)
    val_every: int = 5
    stop_at_accuracy: float | None = None  # early stopping on the held-out accuracy (checked every val_every steps)
    heldout: int = 48
    runners: int = 1
    concurrency: int = 64
    seed: int = 0
    warmup: WarmupPlan = field(default_factory=WarmupPlan)
    warmup_dir: Path | None = None  # default $FULMEN_HOME/demo-warmup
    run_dir: Path | None = None  # default $FULMEN_HOME/runs/<run id>


def run_demo(
    settings: FulmenSettings,
    options: DemoOptions,
    *,
    on_phase: Callable[[str], None] = lambda _: None,
    on_step: Callable[[TrainStep], None] = lambda _: None,
    on_warmup: Callable[[int, int, float], None] = lambda *_: None,
    after: Callable[[DemoRun], None] = lambda _: None,
) -> DemoRun:
    """Run the demo (module docstring). ``on_warmup(step, steps, loss)`` follows a warm-up that is not cached;
    ``after`` runs while the services still run (the report's queries)."""
    started = time.perf_counter()
    check_kafka_can_start(settings)  # a taken broker port fails now, not after minutes of warm-up
    on_phase("warming up the tiny model (cached after the first run)")
    model = warm_up(options.warmup_dir or settings.home / "demo-warmup", options.warmup, on_warmup)
    warmup_s = time.perf_counter() - started
    plan = LocalPlan(options.agent, model, runners=options.runners, concurrency=options.concurrency, run_prefix="demo")
    heldout = heldout_tasks(options.heldout, warmup_count=options.warmup.steps * options.warmup.batch)
    run = run_locally(
        settings,
        plan,
        train_fields(options),
        train_tasks(),
        heldout,
        run_dir=options.run_dir,
        on_phase=on_phase,
        on_step=on_step,
        after=after,
    )
    run.warmup_s = warmup_s
    run.wall_s += warmup_s
    return run


def train_fields(options: DemoOptions) -> dict[str, object]:
    """The demo's ``TrainSection`` fields (a bench that trains on the demo task differently starts from them)."""
    return {
        "steps": options.steps,
        "group_size": options.group_size,
        "groups_per_step": options.groups_per_step,
        "lr": options.lr,
        "val_every": options.val_every,
        "stop_at_val_accuracy": options.stop_at_accuracy,
        "val_group_size": 1,
        "rollout_timeout_s": 120.0,
        "max_attempts": 2,
        "micro_batch_size": 32,
        "device": "cpu",
        "dtype": "float32",
        "seed": options.seed,
        "shuffle_rewards": options.shuffle_rewards,
        "epochs_per_batch": options.epochs_per_batch,
        "kl_coef": options.kl_coef,
        "shuffle": False,
        "algorithm": options.algorithm,
        "mode": options.mode,
        "max_staleness": options.max_staleness,
        # DAPO's overlong shaping needs the calls' length limit: the demo agent's longer call asks for this many
        "overlong_max_tokens": CALL_TOKENS,
    }
