"""Model versions survive a broker outage and a restart, against a real broker: a version whose publish is not
acknowledged is retried and lands exactly once; a run stopped during the outage publishes its saved checkpoint
when it restarts, once; a restart whose version is already on the models topic sends nothing again; a Kafka
failure ends ``train()`` with a readable FulmenError."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiokafka.errors import KafkaConnectionError

import algorithm.train as train_module
from algorithm.collector import Collector
from algorithm.dispatcher import DatasetTask
from algorithm.settings import TrainSettings
from algorithm.train import train
from algorithm.trainer.base import StepMetrics
from infra.errors import BrokerUnavailableError
from infra.kafka.publish import EventPublisher
from infra.settings import FulmenSettings
from schemas import ModelVersion, TopicKey, TrainStep
from tests.integration.test_train_loop import read_topic, simulated_runners

pytestmark = [pytest.mark.integration, pytest.mark.security]

TASKS = [DatasetTask(f"task-{i}", {"question": f"{i} + {i}"}) for i in range(3)]


class RecordingBackend:
    """A trainer backend without torch: steps are counted, a checkpoint is a directory with a config.json."""

    def __init__(self) -> None:
        self.steps = 0

    def step(self, samples) -> StepMetrics:
        self.steps += 1
        return StepMetrics(step=self.steps, loss=0.1, grad_norm=1.0, tokens=4, input_tokens=8, tokens_per_s=1.0,
                           train_s=0.01)  # fmt: skip

    def sft_step(self, samples) -> StepMetrics:  # pragma: no cover - not used by the loop
        raise NotImplementedError

    def save(self, directory: Path | str) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps({"step": self.steps}))
        return directory


def failing_models(failures: int, *, written: bool = False, stop: asyncio.Event | None = None) -> type:
    """An EventPublisher whose first ``failures`` model-version publishes raise the broker's timeout error;
    ``written``: the record is sent and acknowledged first (only the acknowledgement was lost on the way)."""
    state = {"left": failures}

    class Flaky(EventPublisher):
        async def publish_many(self, key, events):
            events = list(events)
            if key is TopicKey.MODELS and state["left"]:
                state["left"] -= 1
                if written:
                    await super().publish_many(key, events)
                if stop is not None and failures - state["left"] >= 2:
                    stop.set()  # SIGTERM while the broker is down
                raise BrokerUnavailableError("publishing to fulmen.models failed: no acknowledgement within 30s")
            return await super().publish_many(key, events)

    return Flaky


def options(settings: FulmenSettings, run_dir: Path, steps: int) -> TrainSettings:
    return TrainSettings(
        home=settings.home, kafka=settings.kafka.model_dump(), clickhouse=settings.clickhouse.model_dump(),
        train={"model_path": "base-weights", "run_dir": run_dir, "run_id": "crash-run", "steps": steps,
               "group_size": 2, "groups_per_step": 1, "consumer_group": "test.trainer", "group_timeout_s": 60},
    )  # fmt: skip


async def train_with_runners(settings: FulmenSettings, run_dir: Path, steps: int,
                             stop: asyncio.Event | None = None) -> list[TrainStep]:  # fmt: skip
    done = asyncio.Event()
    runners = asyncio.create_task(simulated_runners(settings, done))
    try:
        return await asyncio.wait_for(train(options(settings, run_dir, steps), TASKS, None, stop,
                                            backend=RecordingBackend()), 180)  # fmt: skip
    finally:
        done.set()
        await asyncio.wait_for(runners, 60)


async def versions(settings: FulmenSettings) -> list[tuple[int, str, str, str]]:
    return [(v.version, v.uri, v.run_id, v.base_model) for v in await read_topic(settings, TopicKey.MODELS,
                                                                               ModelVersion)]  # fmt: skip


def expected(run_dir: Path, *numbers: int) -> list[tuple[int, str, str, str]]:
    return [(n, str(run_dir / "checkpoints" / f"v{n}"), "crash-run", "base-weights") for n in numbers]


async def test_a_version_whose_acknowledgement_was_lost_lands_exactly_once(
    settings: FulmenSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(train_module, "EventPublisher", failing_models(1, written=True))
    steps = await train_with_runners(settings, tmp_path / "run", steps=2)
    assert [s.step for s in steps] == [1, 2]
    assert await versions(settings) == expected(tmp_path / "run", 1, 2)


async def test_a_version_left_unpublished_by_an_outage_is_published_once_on_restart(
    settings: FulmenSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    stop = asyncio.Event()
    with monkeypatch.context() as patch:
        patch.setattr(train_module, "EventPublisher", failing_models(10**6, stop=stop))
        assert await train_with_runners(settings, run_dir, steps=1, stop=stop) == []  # stopped cleanly
    assert (run_dir / "checkpoints" / "v1" / "config.json").is_file()
    assert await versions(settings) == []  # the outage: v1 saved, never acknowledged
    assert await train_with_runners(settings, run_dir, steps=1) == []  # restart: nothing left to train
    assert await versions(settings) == expected(run_dir, 1)  # ... but v1 is published
    assert await train_with_runners(settings, run_dir, steps=1) == []  # and again
    assert await versions(settings) == expected(run_dir, 1)  # already there: not sent twice


async def test_a_restart_whose_version_is_on_the_topic_publishes_nothing_and_trains_on(
    settings: FulmenSettings, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    assert [s.step for s in await train_with_runners(settings, run_dir, steps=1)] == [1]
    assert [s.step for s in await train_with_runners(settings, run_dir, steps=2)] == [2]  # resumes from v1
    assert await versions(settings) == expected(run_dir, 1, 2)


async def test_a_kafka_failure_during_training_is_a_readable_error(
    settings: FulmenSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broker_gone(self, *args, **kwargs):
        raise KafkaConnectionError("Unable to connect to the broker")

    async def cancelled_while_closing(clients, timeout_s: float = 10.0):
        raise asyncio.CancelledError  # what aiokafka's producer did on stop with the broker gone

    monkeypatch.setattr(Collector, "commit", broker_gone)
    monkeypatch.setattr(train_module, "close_quietly", cancelled_while_closing)
    with pytest.raises(BrokerUnavailableError, match=r"crash-run: Kafka failed during training .*resume"):
        await train_with_runners(settings, tmp_path / "run", steps=1)
