"""``fulmen train`` as a function: build the trainer's parts from :class:`TrainSettings` and run the loop.

:func:`train` resolves the base model (``model_path = "tiny"`` builds the tiny model into
``<run dir>/base-model``), loads the torch backend, starts an idempotent producer and the collector's consumer
(group ``consumer_group`` on the transitions topic), runs :class:`~algorithm.loop.TrainingLoop` and closes the
clients. A run dir that already holds checkpoints resumes: the backend loads the highest ``v<N>`` and the loop
continues with step ``N + 1`` up to ``steps`` (the optimizer state is not saved, so it starts afresh). Only
Kafka is needed: runners, the transitions consumer and the LLM gateway are other processes.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from algorithm.collector import Collector
from algorithm.dispatcher import DatasetTask, Dispatcher
from algorithm.groups import GroupBook
from algorithm.loop import LoopPlan, TrainingLoop
from algorithm.settings import TrainSection, TrainSettings
from algorithm.trainer.base import TrainerBackend
from infra.errors import ConfigurationError
from infra.kafka.clients import close_quietly, consumer, producer, start_or_raise
from infra.kafka.publish import EventPublisher
from schemas.events import RolloutMode, TrainStep
from schemas.topics import TopicKey, topic_name

__all__ = ["build_backend", "latest_checkpoint", "resolve_model", "train"]

log = logging.getLogger(__name__)

TINY = "tiny"


def resolve_model(model_path: str, run_dir: Path) -> str:
    """The base model directory: ``model_path``, or for ``"tiny"`` the tiny model built (once) in the run dir."""
    if not model_path:
        raise ConfigurationError("which model? pass --model PATH (a Hugging Face model directory) or --model tiny, "
                                 "or set FULMEN_TRAIN_MODEL_PATH")  # fmt: skip
    if model_path != TINY:
        return model_path
    from algorithm.tiny_model import build_tiny_model

    directory = run_dir / "base-model"
    if not (directory / "config.json").exists():
        build_tiny_model(directory)
    return str(directory)


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """The highest ``<run_dir>/checkpoints/v<N>`` that holds a model (``config.json``), or None."""
    found = [
        (int(path.name[1:]), path)
        for path in (run_dir / "checkpoints").glob("v*")
        if path.name[1:].isdigit() and (path / "config.json").is_file()
    ]
    return max(found, default=None)


def build_backend(options: TrainSection, model_path: str) -> TrainerBackend:
    """The torch trainer for ``model_path`` with the section's optimisation settings (loads the model)."""
    from algorithm.trainer.torch_backend import LoraSettings, TorchTrainer, TorchTrainerConfig

    lora = LoraSettings(r=options.lora_r, alpha=2.0 * options.lora_r) if options.lora_r else None
    return TorchTrainer(
        TorchTrainerConfig(
            model_path=model_path, device=options.device, dtype=options.dtype, lr=options.lr,
            micro_batch_size=options.micro_batch_size, epochs_per_batch=options.epochs_per_batch,
            clip_eps=options.clip_eps, kl_coef=options.kl_coef, lora=lora, seed=options.seed, max_len=options.max_len,
        )
    )  # fmt: skip


async def train(
    settings: TrainSettings,
    tasks: list[DatasetTask],
    val_tasks: list[DatasetTask] | None = None,
    stop: asyncio.Event | None = None,
    *,
    backend: TrainerBackend | None = None,
) -> list[TrainStep]:
    """Run ``settings.train.steps`` steps on ``tasks`` (validating on ``val_tasks``); the TrainStep events."""
    options = settings.train
    run_dir = settings.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    base_model = await asyncio.to_thread(resolve_model, options.model_path, run_dir)
    resumed = latest_checkpoint(run_dir)
    if resumed is not None:
        log.info("run %s resumes from its checkpoint v%d (%s); the optimizer state starts afresh", options.run_id,
                 resumed[0], resumed[1])  # fmt: skip
    if backend is None:
        backend = await asyncio.to_thread(build_backend, options, str(resumed[1]) if resumed else base_model)
    kafka_producer = producer(settings)
    source = consumer(settings, options.consumer_group, topic_name(TopicKey.TRANSITIONS, settings.kafka.topic_prefix))
    await start_or_raise(kafka_producer, settings, "trainer producer")
    try:
        await start_or_raise(source, settings, "trainer collector")
        publisher = EventPublisher(kafka_producer, prefix=settings.kafka.topic_prefix)
        loop = TrainingLoop(
            LoopPlan(options, run_dir, base_model, resumed[0] if resumed else 0), backend, publisher,
            Collector(source, GroupBook(timeout_s=options.group_deadline_s, policy=options.incomplete_policy,
                                        min_group_size=options.min_group_size)),
            _dispatcher(publisher, tasks, options, RolloutMode.TRAIN),
            _dispatcher(publisher, val_tasks, options, RolloutMode.VAL) if val_tasks else None,
        )  # fmt: skip
        log.info("run %s: training %s for %d steps, %d tasks x %d rollouts, %d groups a step; writing to %s",
                 options.run_id, base_model, options.steps, len(tasks), options.group_size, options.groups_per_step,
                 run_dir)  # fmt: skip
        return await loop.run(stop)
    finally:
        await close_quietly([source, kafka_producer])


def _dispatcher(publisher: EventPublisher, tasks: list[DatasetTask], options: TrainSection,
                mode: RolloutMode) -> Dispatcher:  # fmt: skip
    training = mode is RolloutMode.TRAIN
    return Dispatcher(
        publisher, tasks, mode=mode, cycle=training, shuffle=training and options.shuffle, seed=options.seed,
        group_size=options.group_size if training else options.val_group_size,
        max_in_flight=options.groups_in_flight, rollout_timeout_s=options.rollout_timeout_s,
        max_attempts=options.max_attempts, metadata={"agent": options.agent} if options.agent else None,
    )  # fmt: skip
