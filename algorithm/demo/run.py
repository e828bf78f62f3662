"""The demo's orchestration: warm up, start the system, train through it, validate, report, stop everything.

Lifecycle of :func:`run_demo` (every run gets its own run id, topic prefix ``<run id>.``, consumer groups and
embedded store ``<run dir>/chdb``, so runs never mix, even on a shared broker):

1. the warmed-up tiny model (``warmup``; cached under ``$FULMEN_HOME/demo-warmup`` by its plan);
2. Kafka (``ensure_kafka``: the local broker is started when none runs, and stopped at the end) and topics;
3. ``fulmen consume`` (owns the store, serves read-only SQL on a free port), ``fulmen otlp-gateway``,
   ``fulmen llm-gateway`` on the warmed-up model as version 0 (it follows ``fulmen.models``), and ``runners``
   ``fulmen runner --agent fulmen.algorithm.demo.agent:solve`` processes;
4. the trainer in this process (:func:`fulmen.algorithm.train.train`): GRPO on the generated training set; its
   validation pass runs the held-out set greedily through the same runners, gateway, spans and transitions
   before step 1, every ``val_every`` steps and after the last step (``initial_val_accuracy`` /
   ``val_accuracy`` in ``TrainStep.extra``): that is the accuracy reported, nothing is evaluated outside the
   system. Progress comes from the metrics topic (the ``TrainStep`` events), read by a second consumer;
5. the report: accuracy before/after, curves (PNG), SQL queries run once with ``fulmen sql``;
6. every process is stopped (also on failure or Ctrl-C, which stops training after the current wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fulmen.algorithm.demo.services import Services, ServiceSpec, free_port
from fulmen.algorithm.demo.tasks import heldout_tasks, train_tasks
from fulmen.algorithm.demo.warmup import WarmupPlan, warm_up
from fulmen.algorithm.settings import TrainSettings
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas.events import TrainStep, new_id

__all__ = ["DemoOptions", "DemoRun", "run_demo"]

log = logging.getLogger(__name__)

AGENT = "fulmen.algorithm.demo.agent:solve"


@dataclass(frozen=True)
class DemoOptions:
    """What the demo runs; the defaults are the tuned ones (README: what the demo shows)."""

    steps: int = 30
    shuffle_rewards: bool = False
    group_size: int = 8
    groups_per_step: int = 12  # four of each untaught wording (dispatched in order); see tasks.py
    lr: float = 1e-3
    epochs_per_batch: int = 2  # two PPO-clip passes a step: learning started ~twice as early (README)
    kl_coef: float = 0.1  # without it, lr 1e-3 lost the tool-call format at step 13 of 60 (never recovered)
    val_every: int = 5
    heldout: int = 48
    runners: int = 1
    concurrency: int = 64
    seed: int = 0
    warmup: WarmupPlan = field(default_factory=WarmupPlan)
    warmup_dir: Path | None = None  # default $FULMEN_HOME/demo-warmup
    run_dir: Path | None = None  # default $FULMEN_HOME/runs/<run id>


@dataclass
class DemoRun:
    """The outcome: identifiers, where things are, the TrainStep events and the timings (seconds)."""

    run_id: str
    run_dir: Path
    store_path: Path
    env: dict[str, str]  # FULMEN_* a `fulmen sql` needs to read this run's store while `fulmen consume` runs
    steps: list[TrainStep] = field(default_factory=list)
    final_model: Path | None = None
    warmup_s: float = 0.0
    startup_s: float = 0.0
    train_s: float = 0.0
    wall_s: float = 0.0


def run_demo(settings: FulmenSettings, options: DemoOptions, *, on_phase: Callable[[str], None] = lambda _: None,
             on_step: Callable[[TrainStep], None] = lambda _: None,
             on_warmup: Callable[[int, int, float], None] = lambda *_: None,
             after: Callable[[DemoRun], None] = lambda _: None) -> DemoRun:  # fmt: skip
    """Run the demo (module docstring). ``on_warmup(step, steps, loss)`` follows a warm-up that is not cached;
    ``after`` runs while the services still run (the report's queries)."""
    from fulmen.infra.services import ensure_kafka

    started = time.perf_counter()
    run_id = f"demo-{new_id()[:10]}"
    run_dir = options.run_dir or settings.home / "runs" / run_id
    on_phase("warming up the tiny model (cached after the first run)")
    model = warm_up(options.warmup_dir or settings.home / "demo-warmup", options.warmup, on_warmup)
    run = DemoRun(run_id, run_dir, run_dir / "chdb", {}, warmup_s=time.perf_counter() - started)
    prefix = f"{run_id}."
    run_settings = settings.model_copy(update={"kafka": settings.kafka.model_copy(update={"topic_prefix": prefix})})
    on_phase("starting Kafka (the first run downloads its jars) and creating this run's topics")
    ready = ensure_kafka(run_settings)
    try:
        with Services(run_dir / "logs", _base_env(run_settings, ready.bootstrap, run)) as services:
            _start_services(services, run, model, options, on_phase)
            run.startup_s = time.perf_counter() - started - run.warmup_s
            on_phase("training")
            train_settings = _train_settings(run_settings, ready.bootstrap, run, model, options)
            run.steps = asyncio.run(_train(train_settings, options, services, on_step))
            run.train_s = time.perf_counter() - started - run.warmup_s - run.startup_s
            if run.steps:
                run.final_model = run_dir / "checkpoints" / f"v{run.steps[-1].model_version}"
            after(run)
    finally:
        if ready.started is not None:
            ready.started.stop()
    run.wall_s = time.perf_counter() - started
    return run


def _base_env(settings: FulmenSettings, bootstrap: str, run: DemoRun) -> dict[str, str]:
    run.env = {
        "FULMEN_KAFKA_BOOTSTRAP": bootstrap, "FULMEN_KAFKA_TOPIC_PREFIX": settings.kafka.topic_prefix,
        "FULMEN_HOME": str(settings.home), "FULMEN_CLICKHOUSE_PATH": str(run.store_path),
        "FULMEN_CLICKHOUSE_DATABASE": settings.clickhouse.database,
        "FULMEN_CLICKHOUSE_READ_PORT": str(free_port()),
    }  # fmt: skip
    return run.env | {"FULMEN_LOG_LEVEL": "INFO"}


def _start_services(services: Services, run: DemoRun, model: Path, options: DemoOptions,
                    on_phase: Callable[[str], None]) -> None:  # fmt: skip
    read_port, otlp_port, llm_port = run.env["FULMEN_CLICKHOUSE_READ_PORT"], free_port(), free_port()
    on_phase("starting fulmen consume (spans, rollouts, transitions -> the store)")
    services.start(ServiceSpec("consume", ("consume",), {}, f"http://127.0.0.1:{read_port}/ping"))
    on_phase("starting the OTLP gateway")
    services.start(ServiceSpec("otlp-gateway", ("otlp-gateway",), {"FULMEN_OTLP_PORT": str(otlp_port)},
                               f"http://127.0.0.1:{otlp_port}/readyz"))  # fmt: skip
    on_phase("starting the LLM gateway on the warmed-up model (version 0)")
    llm_env = {"FULMEN_LLM_MODEL": str(model), "FULMEN_LLM_PORT": str(llm_port), "FULMEN_LLM_MODEL_VERSION": "0",
               "FULMEN_LLM_DEVICE": "cpu", "FULMEN_LLM_MAX_BATCH_ROWS": "64",
               "FULMEN_LLM_BATCH_WAIT_MS": "20"}  # fmt: skip
    services.start(ServiceSpec("llm-gateway", ("llm-gateway",), llm_env, f"http://127.0.0.1:{llm_port}/readyz"))
    on_phase(f"starting {options.runners} runner(s) x {options.concurrency} concurrent rollouts")
    runner_env = {"FULMEN_RUNNER_LLM_BASE_URL": f"http://127.0.0.1:{llm_port}",
                  "FULMEN_RUNNER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}/v1/traces",
                  "FULMEN_RUNNER_GROUP": f"{run.run_id}.runners"}  # fmt: skip
    for index in range(options.runners):
        services.start(ServiceSpec(f"runner-{index + 1}", ("runner", "--agent", AGENT, "--concurrency",
                                                           str(options.concurrency)), runner_env))  # fmt: skip


def _train_settings(settings: FulmenSettings, bootstrap: str, run: DemoRun, model: Path,
                    options: DemoOptions) -> TrainSettings:  # fmt: skip
    data = settings.model_dump()
    data["kafka"]["bootstrap"] = bootstrap
    data["train"] = {
        "run_id": run.run_id, "run_dir": run.run_dir, "model_path": str(model), "agent": AGENT,
        "steps": options.steps, "group_size": options.group_size, "groups_per_step": options.groups_per_step,
        "lr": options.lr, "clip_eps": 0.2, "max_staleness": 1, "val_every": options.val_every, "val_group_size": 1,
        "consumer_group": f"{run.run_id}.trainer", "rollout_timeout_s": 120.0, "max_attempts": 2,
        "micro_batch_size": 32, "device": "cpu", "dtype": "float32", "seed": options.seed,
        "shuffle_rewards": options.shuffle_rewards, "epochs_per_batch": options.epochs_per_batch,
        "kl_coef": options.kl_coef, "shuffle": False,
    }  # fmt: skip
    return TrainSettings.model_validate(data)


async def _train(settings: TrainSettings, options: DemoOptions, services: Services,
                 on_step: Callable[[TrainStep], None]) -> list[TrainStep]:  # fmt: skip
    from fulmen.algorithm.demo.progress import watch_metrics
    from fulmen.algorithm.train import train

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(watch_metrics(settings, on_step, stop))
    guard = asyncio.create_task(_guard(services, stop))
    try:
        heldout = heldout_tasks(options.heldout, warmup_count=options.warmup.steps * options.warmup.batch)
        return await train(settings, train_tasks(), heldout, stop)
    finally:
        stop.set()
        for task in (watcher, guard):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _guard(services: Services, stop: asyncio.Event) -> None:
    """Stop training when one of the services died (the error is raised once the trainer has returned)."""
    while not stop.is_set():
        try:
            services.check()
        except Exception:
            log.error("a demo service exited; stopping the training")
            stop.set()
            raise
        await asyncio.sleep(2.0)
