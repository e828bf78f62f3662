"""The trainer service (``fulmen train``) as a function, :func:`run_trainer`: build the trainer's parts from
:class:`TrainSettings` and run the loop.

:func:`run_trainer` resolves the base model (``model_path = "tiny"`` builds the tiny model into
``<run dir>/base-model``), loads the torch backend, starts a broker (idempotent producer) and the collector's consumer
(group ``consumer_group`` on the transitions topic), runs :class:`~fulmen.algorithm.service.loop.TrainingLoop` and
closes the clients. A run dir that already holds checkpoints resumes: the backend loads the highest ``v<N>`` and the
loop continues with step ``N + 1`` up to ``steps`` (the optimizer state is not saved, so it starts afresh). Only
Kafka is needed: runners, the transitions consumer and the LLM gateway are other processes.

Crash safety: checkpoints are written atomically (``v<N>.tmp-<pid>``, then renamed; :func:`latest_checkpoint`
skips and removes the leftovers of a killed save). A run killed after saving ``v<N>`` but before the broker
acknowledged its ``ModelVersion`` publishes it on restart: the models topic is read to its end, and version
``N`` of this run is published only if it is not there (:func:`version_on_topic`), so nothing is sent twice.
A broker outage ends the run, if at all, with a :class:`BrokerUnavailableError` (a readable message), never
a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from aiokafka.errors import KafkaError

from fulmen.algorithm.rl.registry import Registry
from fulmen.algorithm.service.checkpoints import model_in_store, restore_from_store
from fulmen.algorithm.service.collector import Collector
from fulmen.algorithm.service.dispatcher import DatasetTask, Dispatcher
from fulmen.algorithm.service.groups import GroupBook
from fulmen.algorithm.service.loop import LoopPlan, TrainingLoop
from fulmen.algorithm.service.promotion import PromotionGate, Serving, in_force, load_baseline
from fulmen.algorithm.service.reporting import RunReport
from fulmen.algorithm.settings import TrainSection, TrainSettings
from fulmen.algorithm.trainer.base import ADAPTERS_FILE, TEMPORARY_MARK, TrainerBackend
from fulmen.infra.kafka.broker import kafka_broker
from fulmen.infra.kafka.clients import close_quietly, consumer, start_or_raise
from fulmen.infra.kafka.publish import EventPublisher, Sender
from fulmen.infra.kafka.read_all import read_to_end
from fulmen.infra.metrics import MetricsListener
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas.errors import BrokerUnavailableError, ConfigurationError, RetryableError
from fulmen.schemas.events import ModelPromotion, ModelVersion, RolloutMode, TrainStep
from fulmen.schemas.topics import TopicKey, topic_name

if TYPE_CHECKING:
    from fulmen.algorithm.service.replay import ReplayBuffer

__all__ = [
    "TRAINER_BACKENDS",
    "build_backend",
    "check_training_settings",
    "latest_checkpoint",
    "model_versions",
    "resolve_model",
    "run_trainer",
    "torch_config",
    "version_on_topic",
]

log = logging.getLogger(__name__)

# The dispatcher's rollout requests (announced as queued), the loop's model versions and step metrics.
SENDER = Sender(
    "algorithm", (TopicKey.TASKS, TopicKey.ROLLOUTS, TopicKey.MODELS, TopicKey.METRICS, TopicKey.PROMOTIONS)
)

TINY = "tiny"


def resolve_model(model_path: str, run_dir: Path) -> str:
    """The base model directory: ``model_path``, or for ``"tiny"`` the tiny model built (once) in the run dir."""
    if not model_path:
        raise ConfigurationError(
            "which model? pass --model PATH (a Hugging Face model directory) or --model tiny, "
            "or set FULMEN_TRAIN_MODEL_PATH"
        )
    if model_path != TINY:
        return model_path
    from fulmen.algorithm.tiny_model import build_tiny_model

    directory = run_dir / "base-model"
    if not (directory / "config.json").exists():
        build_tiny_model(directory)
    return str(directory)


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """The highest ``<run_dir>/checkpoints/v<N>`` that holds a model (``config.json``) or per-agent adapters
    (``adapters.json``), or None.

    A directory still being written (``v<N>.tmp-<pid>``, see :func:`fulmen.algorithm.trainer.base.atomic_directory`)
    is never a checkpoint; one whose writer is gone (killed during a save) is removed."""
    found = []
    for path in (run_dir / "checkpoints").glob("v*"):
        if TEMPORARY_MARK in path.name:
            _remove_if_stale(path)
        elif path.name[1:].isdigit() and any((path / name).is_file() for name in ("config.json", ADAPTERS_FILE)):
            found.append((int(path.name[1:]), path))
    return max(found, default=None)


def _remove_if_stale(path: Path) -> None:
    """Remove a ``<name>.tmp-<pid>[-old]`` directory unless process ``pid`` (not this one) still runs."""
    writer = path.name.rsplit(TEMPORARY_MARK, 1)[1].removesuffix("-old")
    if writer.isdigit() and int(writer) != os.getpid() and _running(int(writer)):
        return  # another live process may be writing it (a pid reused since is kept too: harmless)
    log.warning("removing %s, left by a checkpoint save that did not finish", path)
    shutil.rmtree(path, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    return True


async def model_versions(settings: FulmenSettings, model_name: str) -> list[ModelVersion]:
    """Every ``ModelVersion`` of ``model_name`` on the models topic now, in offset order: the topic is read from
    the beginning to its end offsets (no consumer group), as the LLM gateway's follower reads it at start.

    Raises :class:`BrokerUnavailableError` when the broker does not answer (within ``READ_TIMEOUT_S``)."""
    return [e for e in await read_to_end(settings, TopicKey.MODELS, ModelVersion) if e.model_name == model_name]


async def version_on_topic(settings: FulmenSettings, event: ModelVersion) -> bool:
    """Whether the models topic holds version ``event.version`` of ``event.model_name`` (of its adapter
    ``event.adapter``) from run ``event.run_id`` (the same version of another run is a different model)."""
    return any(
        found.version == event.version and found.run_id == event.run_id and found.adapter == event.adapter
        for found in await model_versions(settings, event.model_name)
    )


async def promotion_gate(settings: TrainSettings, version: int) -> PromotionGate:
    """The gate of a ``promote_if_better`` run: what serves now, read from the promotions topic (none: the version
    the run starts from); its per-task outcomes come from the run's first validation."""
    current = in_force(await read_to_end(settings, TopicKey.PROMOTIONS, ModelPromotion), settings.train.model_name)
    train = settings.train
    baseline = load_baseline(settings.run_dir) if current is None else None
    if baseline is not None:  # nothing promoted yet: what served when the run started, as it measured it then
        return PromotionGate(baseline[0], train.promote_margin, train.promote_confidence, baseline[1])
    if current is None:
        serving = Serving(version, None, train.run_id)
    else:
        serving = Serving(current.model.version, current.score, current.model.run_id)
        log.info(
            "version %d of %s (run %s) serves, held-out score %s: a candidate must beat it on the same tasks by "
            "more than %g at %g%% confidence",
            serving.version,
            train.model_name,
            serving.run_id,
            serving.score,
            train.promote_margin,
            100 * train.promote_confidence,
        )
    outcomes = current.outcomes if current is not None else {}
    return PromotionGate(serving, train.promote_margin, train.promote_confidence, outcomes)


def check_training_settings(options: TrainSection) -> None:
    """Refuse, with what to set instead, the settings only the trainer can check: the names that live in the torch
    registries (estimator, policy loss, aggregation, correction and its level) and overlong shaping without its
    length limit. ``train`` calls it before loading anything; ``fulmen config show`` does not (it imports no
    torch). Raises ConfigurationError."""
    from fulmen.algorithm.rl.advantages import get_advantage_fn
    from fulmen.algorithm.rl.corrections import get_correction_fn, get_level
    from fulmen.algorithm.rl.losses import get_aggregation, get_policy_loss_fn
    from fulmen.algorithm.rl.recipes import ALGORITHMS

    def named(setting: str, value: str, get) -> None:
        try:
            get(value)
        except ConfigurationError as exc:
            hint = ""
            if value in ALGORITHMS and setting != "ALGORITHM":
                hint = f" ({value} is an algorithm: set FULMEN_TRAIN_ALGORITHM={value}, which selects its pieces)"
            raise ConfigurationError(f"FULMEN_TRAIN_{setting}: {exc.message}{hint}") from None

    named("ESTIMATOR", options.estimator, get_advantage_fn)
    named("POLICY_LOSS", options.policy_loss, get_policy_loss_fn)
    named("LOSS_AGGREGATION", options.loss_aggregation, get_aggregation)
    named("CORRECTION_LEVEL", options.correction_level, get_level)
    if options.applied_correction:
        named("CORRECTION", options.applied_correction, get_correction_fn)
    _ = options.overlong_limits  # raises when overlong shaping is on without its limit


BackendBuilder = Callable[[TrainSection, str], TrainerBackend]

TRAINER_BACKENDS: Registry[BackendBuilder] = Registry("trainer backend")
"""``FULMEN_TRAIN_BACKEND`` -> ``build(options, model_path)``: the backend that trains the run's model."""


def build_backend(options: TrainSection, model_path: str) -> TrainerBackend:
    """The section's backend (``options.backend``) for ``model_path`` (loads the model); ConfigurationError
    listing the valid names for an unknown one."""
    return TRAINER_BACKENDS.get(options.backend)(options, model_path)


def torch_config(options: TrainSection, model_path: str):  # -> TorchTrainerConfig
    """The torch trainer's config from the section's optimisation settings."""
    from fulmen.algorithm.trainer.torch_backend import LoraSettings, TorchTrainerConfig

    lora = LoraSettings(r=options.lora_r, alpha=2.0 * options.lora_r) if options.lora_r else None
    return TorchTrainerConfig(
        model_path=model_path,
        device=options.device,
        dtype=options.dtype,
        lr=options.lr,
        micro_batch_size=options.micro_batch_size,
        micro_batch_tokens=options.micro_batch_tokens or None,
        epochs_per_batch=options.epochs_per_batch,
        clip_eps=options.clip_eps,
        clip_eps_high=options.clip_eps_high,
        policy_loss=options.policy_loss,
        aggregation=options.loss_aggregation,
        kl_coef=options.kl_coef,
        lora=lora,
        seed=options.seed,
        max_len=options.max_len,
        recompute_old_logprobs=options.recompute_old_logprobs,
        correction=options.applied_correction,
        correction_level=options.correction_level,
        correction_low=options.correction_low,
        correction_high=options.correction_high,
    )


@TRAINER_BACKENDS.register("torch")
def _torch_backend(options: TrainSection, model_path: str) -> TrainerBackend:
    """One process (:class:`TorchTrainer`); as rank 0 of a torchrun job, FSDP2 over its ranks
    (:class:`~fulmen.algorithm.trainer.distributed.RankZeroBackend`, the other ranks run ``serve``)."""
    from fulmen.algorithm.trainer import distributed
    from fulmen.algorithm.trainer.torch_backend import TorchTrainer

    config = torch_config(options, model_path)
    if not distributed.launched():
        return TorchTrainer(config)
    model_uri = None  # ranks on other machines fetch the model rank 0 starts from out of the object store
    if distributed.several_machines() and options.checkpoint_uri:
        model_uri = model_in_store(Path(model_path), options.run_id, options.checkpoint_uri)
    world = distributed.join(options.device, options.dist_timeout_s)
    return distributed.RankZeroBackend.start(config, world, model_uri)


def _per_agent_backend(options: TrainSection, base_model: str, resume_from: Path | None) -> TrainerBackend:
    """One LoRA adapter per agent of ``adapter_agents`` on ``base_model``
    (:class:`~fulmen.algorithm.trainer.adapters.PerAgentTrainer`), resumed from a per-agent checkpoint if given."""
    from fulmen.algorithm.trainer.adapters import PerAgentTrainer, is_adapter_checkpoint

    if resume_from is not None and not is_adapter_checkpoint(resume_from):
        raise ConfigurationError(
            f"FULMEN_TRAIN_ADAPTERS=per_agent, but the checkpoint to resume from, {resume_from}, "
            "holds a whole model (this run trained without per-agent adapters): start a new run "
            "(another FULMEN_TRAIN_RUN_ID)"
        )
    return PerAgentTrainer(torch_config(options, base_model), options.per_agent or [], resume_from)


@TRAINER_BACKENDS.register("verl")
def _verl_backend(options: TrainSection, model_path: str) -> TrainerBackend:
    """verl's FSDP engine and PPO loss (:class:`~fulmen.algorithm.trainer.verl_backend.VerlTrainer`), one process."""
    from fulmen.algorithm.trainer.verl_backend import VerlTrainer

    return VerlTrainer(torch_config(options, model_path))


async def run_trainer(
    settings: TrainSettings,
    tasks: list[DatasetTask],
    val_tasks: list[DatasetTask] | None = None,
    stop: asyncio.Event | None = None,
    *,
    backend: TrainerBackend | None = None,
    replay: ReplayBuffer | None = None,
    weights_from: Path | None = None,
) -> list[TrainStep]:
    """Run ``settings.train.steps`` steps on ``tasks`` (validating on ``val_tasks``) and, with ``replay_sql``, on
    the stored rollouts it selects (``replay``: that selection's buffer, already read); the TrainStep events.

    ``weights_from``: a run that already has checkpoints goes on from these weights (an earlier version of the run,
    or the model it started from) rather than its latest version, with a fresh optimizer; its steps are still
    numbered after the latest (``fulmen improve`` after a round whose versions were all refused)."""
    options = settings.train
    check_training_settings(options)
    if options.tasks_sql:
        tasks = [*tasks, *await asyncio.to_thread(load_selected_tasks, settings)]
    if options.stop_at_val_accuracy is not None and not val_tasks:
        raise ConfigurationError("--stop-at-val-accuracy stops on the held-out accuracy: pass --val FILE")
    if options.promote_if_better and not val_tasks:
        raise ConfigurationError("--promote-if-better judges each version on held-out tasks: pass --val FILE")
    if options.promote_if_better and options.per_agent:
        raise ConfigurationError("--promote-if-better promotes one model; per-agent adapters are not gated yet")
    if options.steps == 0 and not val_tasks:
        raise ConfigurationError(
            "--steps 0 validates the model once and stops: pass --val FILE (the tasks to validate on)"
        )
    if not tasks and not options.replay_sql and options.steps > 0:
        raise ConfigurationError(
            "nothing to train on: give training tasks (--dataset or --tasks-sql) or rollouts to replay (--replay SQL)"
        )
    run_dir = settings.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    base_model = await asyncio.to_thread(resolve_model, options.model_path, run_dir)
    resumed = await asyncio.to_thread(_resumed, options, run_dir)
    if backend is not None:
        return await _train_with(backend, settings, base_model, resumed, tasks, val_tasks, stop, replay)
    start = weights_from if weights_from is not None and resumed is not None else (resumed[1] if resumed else None)
    if start is not None and start != (resumed[1] if resumed else None):
        log.info("run %s: goes on from %s (not its latest version v%d)", options.run_id, start, resumed[0])
    if options.per_agent:
        built = await asyncio.to_thread(_per_agent_backend, options, base_model, start)
    else:
        built = await asyncio.to_thread(build_backend, options, str(start) if start else base_model)
    if start is not None and not await asyncio.to_thread(_load_state, built, start):
        log.info("run %s: %s has no optimizer state; the optimizer starts afresh", options.run_id, start)
    try:
        return await _train_with(built, settings, base_model, resumed, tasks, val_tasks, stop, replay)
    finally:
        close = getattr(built, "close", None)  # a sharded backend lets its other ranks end
        if close is not None:
            await asyncio.to_thread(close)


async def _train_with(
    backend: TrainerBackend,
    settings: TrainSettings,
    base_model: str,
    resumed: tuple[int, Path] | None,
    tasks: list[DatasetTask],
    val_tasks: list[DatasetTask] | None,
    stop: asyncio.Event | None,
    replay: ReplayBuffer | None = None,
) -> list[TrainStep]:
    options = settings.train
    run_dir = settings.run_dir
    report = RunReport(run_dir, options.run_id, options.report_to, options.model_dump(mode="json"))
    broker = kafka_broker(settings)
    source = consumer(settings, options.consumer_group, topic_name(TopicKey.TRANSITIONS, settings.kafka.topic_prefix))
    metrics = MetricsListener.from_settings(settings.metrics, what=f"run {options.run_id}")
    await start_or_raise(broker, settings, "trainer publisher")
    try:
        if metrics is not None:
            await metrics.start()
        await start_or_raise(source, settings, "trainer collector")
        publisher = EventPublisher(broker, SENDER)
        if replay is None and options.replay_sql:
            replay = await asyncio.to_thread(load_replay_buffer, settings, base_model)
        if (
            replay is not None
            and resumed is not None
            and replay.restore_position(run_dir, resumed[0], options.replay_sql)
        ):
            log.info("run %s: replay goes on past the groups trained on up to v%d", options.run_id, resumed[0])
        gate = await promotion_gate(settings, resumed[0] if resumed else 0) if options.promote_if_better else None
        loop = TrainingLoop(
            LoopPlan(options, run_dir, base_model, resumed[0] if resumed else 0),
            backend,
            publisher,
            Collector(source, _group_book(options)),
            _dispatcher(publisher, tasks, options, RolloutMode.TRAIN, resumed[0] if resumed else 0) if tasks else None,
            _dispatcher(publisher, val_tasks, options, RolloutMode.VAL) if val_tasks else None,
            version_published=lambda event: version_on_topic(settings, event),
            replay=replay,
            gate=gate,
            on_step=report.step,
        )
        stop = stop or asyncio.Event()
        if not await loop.publish_resumed(stop):
            return []
        _log_start(options, base_model, len(tasks), run_dir, loop.replay_share, replay)
        return await loop.run(stop)
    except BrokerUnavailableError:
        raise
    except (KafkaError, RetryableError) as exc:  # a Kafka failure the loop did not wrap (a failed commit):
        # say what happened and how to resume, not a traceback
        raise BrokerUnavailableError(
            f"run {options.run_id}: Kafka failed during training ({type(exc).__name__}: {exc}); the checkpoints "
            f"in {run_dir / 'checkpoints'} are kept: start `fulmen train` again to resume"
        ) from exc
    finally:
        await _close([source, broker])
        if metrics is not None:
            await metrics.stop()
        curves = await asyncio.to_thread(report.close)
        if curves is not None:
            log.info("run %s: curves in %s, metrics in %s", options.run_id, curves, report.metrics)


def _resumed(options: TrainSection, run_dir: Path) -> tuple[int, Path] | None:
    """The checkpoint a run resumes from (None: it starts). A run that already took its ``steps`` and recorded the
    last one (published, in ``metrics.jsonl``) is refused; one stopped between saving its last checkpoint and
    publishing it goes on, and publishes that version (once) with nothing left to train."""
    from fulmen.algorithm.service.reporting import read_metrics

    resumed = latest_checkpoint(run_dir)
    if resumed is None and options.checkpoint_uri:  # a machine without the run's disk: the store has its versions
        restored = restore_from_store(run_dir, options.run_id, options.checkpoint_uri)
        resumed = latest_checkpoint(run_dir) if restored is not None else None
    if resumed is None:
        return None
    recorded = {int(row["step"]) for row in read_metrics(run_dir / "metrics.jsonl")}
    if options.steps and resumed[0] >= options.steps and resumed[0] in recorded:
        raise ConfigurationError(
            f"run {options.run_id} is finished: its checkpoint v{resumed[0]} is step {resumed[0]} of --steps "
            f"{options.steps}; pass --steps N above {resumed[0]} to train it further, or another --run to start anew"
        )
    log.info("run %s resumes from its checkpoint v%d (%s)", options.run_id, resumed[0], resumed[1])
    return resumed


def _load_state(backend: TrainerBackend, checkpoint: Path) -> bool:
    load = getattr(backend, "load_training_state", None)
    return bool(load is not None and load(checkpoint))


def _group_book(options: TrainSection) -> GroupBook:
    return GroupBook(
        timeout_s=options.group_deadline_s, policy=options.incomplete_policy, min_group_size=options.min_group_size
    )


def _log_start(
    options: TrainSection, base_model: str, tasks: int, run_dir: Path, replay_share: int, replay: ReplayBuffer | None
) -> None:
    log.info(
        "run %s: training %s for %d steps, %d tasks x %d rollouts, %d groups a step; writing to %s",
        options.run_id,
        base_model,
        options.steps,
        tasks,
        options.group_size,
        options.groups_per_step,
        run_dir,
    )
    if replay is not None:
        log.info(
            "run %s replays %s; %d of each step's %d groups",
            options.run_id,
            replay.summary(),
            replay_share,
            options.groups_per_step,
        )


async def _close(clients: list) -> None:
    """Close the clients; a ``CancelledError`` raised by a client's own shutdown (aiokafka cancels its sender
    task) is logged, not raised, so the error that ended the run is the one reported. A cancellation of this
    task itself (Ctrl-C) still propagates."""
    try:
        await close_quietly(clients)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.warning("a Kafka client was cancelled while closing; abandoning it")


def source_store_settings(settings: FulmenSettings, where: str) -> FulmenSettings:
    """The settings that reach the store ``where`` names (``source_store``): '' = these; an http(s) URL = that
    ClickHouse server; else an embedded store's directory (opened here: no other process may hold it)."""
    if not where:
        return settings
    clickhouse = settings.clickhouse.model_copy()
    if where.startswith(("http://", "https://")):
        clickhouse = type(clickhouse).model_validate({**clickhouse.model_dump(), "url": where})
    else:
        if not Path(where).is_dir():
            raise ConfigurationError(
                f"FULMEN_TRAIN_SOURCE_STORE={where}: no such store directory (an embedded "
                "store's directory, or an http(s):// ClickHouse URL)"
            )
        clickhouse = clickhouse.model_copy(update={"url": None, "path": Path(where), "read_port": 0})
    return settings.model_copy(update={"clickhouse": clickhouse})


def load_selected_tasks(settings: TrainSettings) -> list[DatasetTask]:
    """The tasks ``tasks_sql`` selects, with their stored payloads, from ``source_store``."""
    from fulmen.algorithm.service.stored_tasks import load_stored_tasks
    from fulmen.infra.store import open_reader

    store = source_store_settings(settings, settings.train.source_store)
    reader = open_reader(store)
    try:
        tasks = load_stored_tasks(reader, settings.train.tasks_sql, database=store.clickhouse.database)
    finally:
        reader.close()
    log.info("run %s: %d task(s) from the store (--tasks-sql)", settings.train.run_id, len(tasks))
    return tasks


def load_replay_buffer(
    settings: TrainSettings,
    base_model: str,
    *,
    selection: str | None = None,
    require_reward: bool = True,
    allow_empty: bool = False,
) -> ReplayBuffer:
    """The run's replay buffer: ``replay_sql`` (or ``selection``) run against ``source_store`` (see
    :mod:`fulmen.algorithm.service.replay`; ``require_reward`` and ``allow_empty`` as there)."""
    from transformers import AutoConfig

    from fulmen.algorithm.service.replay import load_replay
    from fulmen.infra.store import open_reader

    options = settings.train
    store = source_store_settings(settings, options.source_store)
    vocab = getattr(AutoConfig.from_pretrained(base_model), "vocab_size", None)
    reader = open_reader(store)
    try:
        return load_replay(
            reader,
            options.replay_sql if selection is None else selection,
            database=store.clickhouse.database,
            model_name=options.model_name,
            base_model=base_model,
            vocab_size=vocab,
            group_size=options.group_size,
            require_reward=require_reward,
            allow_empty=allow_empty,
        )
    finally:
        reader.close()


def _dispatcher(
    publisher: EventPublisher, tasks: list[DatasetTask], options: TrainSection, mode: RolloutMode, after_step: int = 0
) -> Dispatcher:
    """The dispatcher of ``mode``'s tasks; a training one resumed after step ``after_step`` starts past the groups
    those steps trained on (``groups_per_step`` each)."""
    training = mode is RolloutMode.TRAIN
    dispatcher = Dispatcher(
        publisher,
        tasks,
        mode=mode,
        cycle=training,
        shuffle=training and options.shuffle,
        seed=options.seed,
        group_size=options.group_size if training else options.val_group_size,
        max_in_flight=options.groups_in_flight,
        rollout_timeout_s=options.rollout_timeout_s,
        max_attempts=options.max_attempts,
        metadata={"agent": options.agent} if options.agent else None,
        prompt_bundle=options.prompt_bundle or None,
    )
    if training:
        dispatcher.skip(after_step * options.groups_per_step)
    return dispatcher
