"""Train an agent through the whole system on one machine: the demo's and the examples' one mechanism.

:func:`run_locally` gives every run its own run id, topic prefix ``<run id>.``, consumer groups and embedded
store ``<run dir>/chdb``, so runs never mix, even on a shared broker, and then:

1. Kafka (``ensure_kafka``: the local broker is started when none runs, and stopped at the end) and topics;
2. ``fulmen consume`` (owns the store, serves read-only SQL on a free port; ``FULMEN_TRANSITIONS_AGENT_PATTERN``
   when the plan selects agents), ``fulmen otlp-gateway``, ``fulmen llm-gateway`` on the plan's model as version
   0 (it follows ``fulmen.models``), and ``runners`` ``fulmen runner --agent <plan.agent>`` processes, each the
   real command in its own process, configured as ``fulmen up`` configures them (:mod:`fulmen.infra.stack`);
3. the trainer in this process (:func:`train_in_stack`: :func:`fulmen.algorithm.service.run.run_trainer` with the given
   ``FULMEN_TRAIN_*`` fields, after publishing the prompt bundles its rollouts name on the run's prompts topic);
   its validation pass runs the held-out tasks through the same runners, gateway, spans and transitions before
   step 1, every ``val_every`` steps and after the last step (``initial_val_accuracy`` / ``val_accuracy`` in
   ``TrainStep.extra``). Progress comes from the metrics topic (the ``TrainStep`` events), read by a second
   consumer; a service that dies stops the training with its log's tail;
4. ``after(run)`` while everything still runs (queries for a report), then every process is stopped (also on
   failure or Ctrl-C, which stops training after the current wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fulmen.algorithm.service.dispatcher import DatasetTask
from fulmen.algorithm.settings import TrainSettings
from fulmen.infra.processes import Services
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.stack import StackPorts, core_services, runner_spec
from fulmen.schemas.events import TrainStep, new_id
from fulmen.schemas.prompts import PromptBundle

__all__ = ["LocalPlan", "LocalRun", "LocalStack", "TrainReport", "local_stack", "run_locally", "train_in_stack"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalPlan:
    """What runs: the agent (``module:function``), the model served as version 0 and trained, the runners, which
    agents' calls become transitions (None: all), and extra ``FULMEN_*`` variables for the LLM gateway."""

    agent: str
    model: Path
    runners: int = 1
    concurrency: int = 32
    agent_pattern: str | None = None
    llm_env: dict[str, str] = field(default_factory=dict)
    run_prefix: str = "run"
    run_id: str | None = None  # a named run (started, or resumed from its checkpoints); None: a new id each time


@dataclass
class LocalRun:
    """The outcome: identifiers, where things are, the TrainStep events and the timings (seconds)."""

    run_id: str
    run_dir: Path
    store_path: Path
    env: dict[str, str]  # FULMEN_* a `fulmen sql` needs to read this run's store while `fulmen consume` runs
    steps: list[TrainStep] = field(default_factory=list)
    final_model: Path | None = None
    warmup_s: float = 0.0  # preparing the model before the run (the demo's warm-up)
    startup_s: float = 0.0
    train_s: float = 0.0
    wall_s: float = 0.0

    def accuracy_curve(self) -> list[tuple[int, float]]:
        """``(step, held-out accuracy)`` points: step 0 (before training), then each validation."""
        points = []
        if self.steps and "initial_val_accuracy" in self.steps[0].extra:
            points.append((0, self.steps[0].extra["initial_val_accuracy"]))
        return points + [(s.step, s.extra["val_accuracy"]) for s in self.steps if "val_accuracy" in s.extra]

    def report(self) -> TrainReport:
        """What the run gave, without its events (``fulmen.train``'s answer)."""
        return TrainReport(
            run_id=self.run_id,
            run_dir=self.run_dir,
            steps=len(self.steps),
            final_model=self.final_model,
            reward_curve=[(s.step, s.reward_mean) for s in self.steps],
            val_accuracy_curve=self.accuracy_curve(),
            loss_curve=[(s.step, s.loss) for s in self.steps],
            wall_s=self.wall_s,
        )


@dataclass(frozen=True)
class TrainReport:
    """A local training run's report: steps trained, the curves as ``(step, value)`` points (held-out accuracy
    at step 0 is before the first update; empty without held-out tasks), the last checkpoint (a Hugging Face
    directory; None when no step was trained), the run's id and directory, and its wall time (seconds)."""

    run_id: str
    run_dir: Path
    steps: int
    final_model: Path | None
    reward_curve: list[tuple[int, float]]
    val_accuracy_curve: list[tuple[int, float]]
    loss_curve: list[tuple[int, float]]
    wall_s: float

    @property
    def curves(self) -> dict[str, list[tuple[int, float]]]:
        return {"reward": self.reward_curve, "val_accuracy": self.val_accuracy_curve, "loss": self.loss_curve}


def run_locally(
    settings: FulmenSettings,
    plan: LocalPlan,
    train: dict[str, Any],
    tasks: Sequence[DatasetTask],
    val_tasks: Sequence[DatasetTask] | None,
    *,
    run_dir: Path | None = None,
    on_phase: Callable[[str], None] = lambda _: None,
    on_step: Callable[[TrainStep], None] = lambda _: None,
    after: Callable[[LocalRun], None] = lambda _: None,
    bundles: Sequence[PromptBundle] = (),
) -> LocalRun:
    """Run the system and train ``plan.agent`` (module docstring). ``train`` holds ``TrainSection`` fields; the
    run's identity, model, agent and consumer group are set here. ``bundles``: published on the run's prompts topic
    before training (the one ``train['prompt_bundle']`` names must be among them or already there)."""
    with local_stack(settings, plan, run_dir=run_dir, on_phase=on_phase) as stack:
        train_in_stack(stack, plan, train, tasks, val_tasks, on_phase=on_phase, on_step=on_step, bundles=bundles)
        after(stack.run)
    return stack.run


def train_in_stack(
    stack: LocalStack,
    plan: LocalPlan,
    train: dict[str, Any],
    tasks: Sequence[DatasetTask],
    val_tasks: Sequence[DatasetTask] | None,
    *,
    on_phase: Callable[[str], None] = lambda _: None,
    on_step: Callable[[TrainStep], None] = lambda _: None,
    bundles: Sequence[PromptBundle] = (),
) -> list[TrainStep]:
    """Step 3 of the module docstring on a running :func:`local_stack`: publish ``bundles`` (acknowledged before any
    rollout names one), then train; the steps are added to ``stack.run`` (a prompt search's stack trains after its
    search with this too: ``fulmen.optimize_prompt(train_steps=N)``)."""
    from fulmen.algorithm.prompts.bundles import publish_bundles

    run = stack.run
    if bundles:
        on_phase(f"publishing prompt bundle(s) {', '.join(b.bundle_id for b in bundles)} for this run's rollouts")
        asyncio.run(publish_bundles(stack.client_settings(), bundles))
    on_phase(
        "training"
        + (f" on rollouts naming prompt bundle {train['prompt_bundle']}" if train.get("prompt_bundle") else "")
    )
    train_settings = _train_settings(stack.settings, stack.bootstrap, run, plan, train)
    began = time.perf_counter()
    steps = asyncio.run(_train(train_settings, list(tasks), list(val_tasks or []), stack.services, on_step))
    run.train_s += time.perf_counter() - began
    run.steps += steps
    if run.steps:
        run.final_model = run.run_dir / "checkpoints" / f"v{run.steps[-1].model_version}"
    return steps


@dataclass
class LocalStack:
    """A running local stack (:func:`local_stack`): the run, its services, the run's settings (its topic prefix)
    with the broker's address, and when it started (``time.perf_counter``)."""

    run: LocalRun
    services: Services
    settings: FulmenSettings
    bootstrap: str
    ports: StackPorts
    started: float

    def client_settings(self) -> FulmenSettings:
        """Settings for a client of this run in this process: its broker and topic prefix, and its store read
        through ``fulmen consume``'s read port (``open_reader``)."""
        kafka = self.settings.kafka.model_copy(update={"bootstrap": self.bootstrap})
        clickhouse = self.settings.clickhouse.model_copy(
            update={"url": None, "path": self.run.store_path, "read_port": self.ports.read}
        )
        return self.settings.model_copy(update={"kafka": kafka, "clickhouse": clickhouse})


@contextlib.contextmanager
def local_stack(
    settings: FulmenSettings,
    plan: LocalPlan,
    *,
    run_dir: Path | None = None,
    on_phase: Callable[[str], None] = lambda _: None,
) -> Iterator[LocalStack]:
    """Steps 1 and 2 of the module docstring: Kafka, this run's topics, ``fulmen consume``, both gateways and the
    runners of ``plan.agent``, all stopped when the block ends (also on failure). What runs inside the block is the
    caller's: training (:func:`run_locally`) or a prompt search (``fulmen.optimize_prompt``)."""
    from fulmen.infra.services import ensure_kafka

    started = time.perf_counter()
    run_id = plan.run_id or f"{plan.run_prefix}-{new_id()[:10]}"
    run_dir = run_dir or settings.home / "runs" / run_id
    run = LocalRun(run_id, run_dir, run_dir / "chdb", {})
    kafka = settings.kafka.model_copy(update={"topic_prefix": f"{run_id}."})
    run_settings = settings.model_copy(update={"kafka": kafka})
    on_phase("starting Kafka (the first run downloads its jars) and creating this run's topics")
    ready = ensure_kafka(run_settings)
    try:
        ports = StackPorts.free()
        with Services(run_dir / "logs", _base_env(run_settings, ready.bootstrap, run, ports)) as services:
            _start_services(services, run, plan, ports, on_phase)
            run.startup_s = time.perf_counter() - started
            yield LocalStack(run, services, run_settings, ready.bootstrap, ports, started)
    finally:
        if ready.started is not None:
            ready.started.stop()
    run.wall_s = time.perf_counter() - started


def _base_env(settings: FulmenSettings, bootstrap: str, run: LocalRun, ports: StackPorts) -> dict[str, str]:
    run.env = {
        "FULMEN_KAFKA_BOOTSTRAP": bootstrap,
        "FULMEN_KAFKA_TOPIC_PREFIX": settings.kafka.topic_prefix,
        "FULMEN_HOME": str(settings.home),
        "FULMEN_CLICKHOUSE_PATH": str(run.store_path),
        "FULMEN_CLICKHOUSE_DATABASE": settings.clickhouse.database,
        "FULMEN_CLICKHOUSE_READ_PORT": str(ports.read),
    }
    return run.env | {"FULMEN_LOG_LEVEL": "INFO"}


PHASES = {
    "consume": "starting fulmen consume (spans, rollouts, transitions -> the store)",
    "otlp-gateway": "starting the OTLP gateway",
    "llm-gateway": "starting the LLM gateway on {model} (version 0)",
}


def _start_services(
    services: Services, run: LocalRun, plan: LocalPlan, ports: StackPorts, on_phase: Callable[[str], None]
) -> None:
    consume_env = {"FULMEN_TRANSITIONS_AGENT_PATTERN": plan.agent_pattern} if plan.agent_pattern else {}
    llm_env = {
        "FULMEN_LLM_DEVICE": "cpu",
        "FULMEN_LLM_MAX_BATCH_ROWS": "64",
        "FULMEN_LLM_BATCH_WAIT_MS": "20",
    } | plan.llm_env
    for spec in core_services(ports, model=str(plan.model), consume_env=consume_env, llm_env=llm_env):
        on_phase(PHASES[spec.name].format(model=plan.model))
        services.start(spec)
    on_phase(f"starting {plan.runners} runner(s) x {plan.concurrency} concurrent rollouts of {plan.agent}")
    for index in range(plan.runners):
        services.start(
            runner_spec(index + 1, ports, agent=plan.agent, concurrency=plan.concurrency, group=f"{run.run_id}.runners")
        )


def _train_settings(
    settings: FulmenSettings, bootstrap: str, run: LocalRun, plan: LocalPlan, train: dict[str, Any]
) -> TrainSettings:
    data = settings.model_dump()
    data["kafka"]["bootstrap"] = bootstrap
    data["train"] = train | {
        "run_id": run.run_id,
        "run_dir": run.run_dir,
        "model_path": str(plan.model),
        "agent": plan.agent,
        "consumer_group": f"{run.run_id}.trainer",
    }
    return TrainSettings.model_validate(data)


async def _train(
    settings: TrainSettings,
    tasks: list[DatasetTask],
    val_tasks: list[DatasetTask],
    services: Services,
    on_step: Callable[[TrainStep], None],
) -> list[TrainStep]:
    from fulmen.algorithm.demo.progress import watch_metrics
    from fulmen.algorithm.service.run import run_trainer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(watch_metrics(settings, on_step, stop))
    guard = asyncio.create_task(_guard(services, stop))
    try:
        return await run_trainer(settings, tasks, val_tasks or None, stop)
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
            log.error("a service exited; stopping the training")
            stop.set()
            raise
        await asyncio.sleep(2.0)
