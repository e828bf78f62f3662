"""Model versions survive a broker outage and a restart, against a real broker: a version whose publish is not
acknowledged is retried and lands exactly once, also when the broker is stopped as it is sent and its record is
still in the producer's buffer when the retry begins; a run stopped during the outage publishes its saved checkpoint
when it restarts, once; a restart whose version is already on the models topic sends nothing again; a Kafka
failure ends ``run_trainer()`` with a readable FulmenError."""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError

import fulmen.algorithm.service.run as train_module
from fulmen.algorithm.service.collector import Collector
from fulmen.algorithm.service.dispatcher import DatasetTask
from fulmen.algorithm.service.loop import TrainingLoop
from fulmen.algorithm.service.run import run_trainer
from fulmen.algorithm.settings import TrainSettings
from fulmen.algorithm.trainer.base import StepMetrics
from fulmen.infra.kafka.local import LocalKafka
from fulmen.infra.kafka.publish import EventPublisher
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas import ModelVersion, TopicKey, TrainStep
from fulmen.schemas.errors import BrokerUnavailableError
from tests.integration.test_train_loop import read_topic, simulated_runners

pytestmark = [pytest.mark.integration, pytest.mark.security]

TASKS = [DatasetTask(f"task-{i}", {"question": f"{i} + {i}"}) for i in range(3)]


class RecordingBackend:
    """A trainer backend without torch: steps are counted, a checkpoint is a directory with a config.json."""

    def __init__(self) -> None:
        self.steps = 0

    def step(self, samples) -> StepMetrics:
        self.steps += 1
        return StepMetrics(
            step=self.steps, loss=0.1, grad_norm=1.0, tokens=4, input_tokens=8, tokens_per_s=1.0, train_s=0.01
        )

    def sft_step(self, samples) -> StepMetrics:  # pragma: no cover - not used by the loop
        raise AssertionError("the training loop never warms a backend up")

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
        home=settings.home,
        kafka=settings.kafka.model_dump(),
        clickhouse=settings.clickhouse.model_dump(),
        train={
            "model_path": "base-weights",
            "run_dir": run_dir,
            "run_id": "crash-run",
            "steps": steps,
            "group_size": 2,
            "groups_per_step": 1,
            "consumer_group": "test.trainer",
            "group_timeout_s": 60,
        },
    )


async def train_with_runners(
    settings: FulmenSettings, run_dir: Path, steps: int, stop: asyncio.Event | None = None
) -> list[TrainStep]:
    done = asyncio.Event()
    runners = asyncio.create_task(simulated_runners(settings, done))
    try:
        return await asyncio.wait_for(
            run_trainer(options(settings, run_dir, steps), TASKS, None, stop, backend=RecordingBackend()), 180
        )
    finally:
        done.set()
        await asyncio.wait_for(runners, 60)


async def versions(settings: FulmenSettings) -> list[tuple[int, str, str, str]]:
    return [
        (v.version, v.uri, v.run_id, v.base_model) for v in await read_topic(settings, TopicKey.MODELS, ModelVersion)
    ]


def expected(run_dir: Path, *numbers: int) -> list[tuple[int, str, str, str]]:
    return [(n, str(run_dir / "checkpoints" / f"v{n}"), "crash-run", "base-weights") for n in numbers]


async def test_a_version_whose_acknowledgement_was_lost_lands_exactly_once(
    settings: FulmenSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(train_module, "EventPublisher", failing_models(1, written=True))
    steps = await train_with_runners(settings, tmp_path / "run", steps=2)
    assert [s.step for s in steps] == [1, 2]
    assert await versions(settings) == expected(tmp_path / "run", 1, 2)


PRODUCER_RETRY_S = 60.0
"""The producer's wait before it sends a failed batch again (100 ms by default): longer than the broker takes to
stop, time the publish out and start again (up to 40 s seen on a busy machine), so the loop's retry reads the
models topic while the first record is still in the producer's buffer (with a multi-broker cluster, a produce
refused for want of in-sync replicas while reads go on does the same)."""


def restarted_mid_publish(broker: LocalKafka, settings: FulmenSettings, state: dict[str, bool]) -> type:
    """An EventPublisher that stops the broker as the first model version is sent (the producer knows the topic,
    as it does mid-run; the record waits in its buffer), times out after 2 s and starts the broker again. Sets
    ``state["buffered_when_back"]``: whether the record had not landed yet once the broker was back."""

    class Interrupted(EventPublisher):
        def __init__(self, faststream_broker, sender) -> None:
            super().__init__(faststream_broker, sender, timeout_s=2.0)

        async def publish_many(self, key, events):
            if key is not TopicKey.MODELS or state["interrupted"]:
                return await super().publish_many(key, events)
            state["interrupted"] = True
            producer = self.broker.config.producer._producer.producer  # faststream's private hold on aiokafka's
            assert isinstance(producer, AIOKafkaProducer)
            await producer.partitions_for(self.topic_name(key))
            sender = producer._sender  # aiokafka's private sender: its produce retries wait _retry_backoff
            assert isinstance(sender._retry_backoff, float)  # (an upgrade that renames it must fail here)
            sender._retry_backoff = PRODUCER_RETRY_S  # set after start: starting still retries every 100 ms
            await asyncio.to_thread(broker.stop)
            try:
                return await super().publish_many(key, events)
            finally:
                await asyncio.to_thread(broker.start)
                state["buffered_when_back"] = await versions(settings) == []

    return Interrupted


async def test_a_version_sent_as_the_broker_stops_and_restarts_lands_exactly_once(
    settings: FulmenSettings, kafka_broker: LocalKafka, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    RecordingBackend().save(run_dir / "checkpoints" / "v1")  # saved, then killed before the publish
    state = {"interrupted": False, "buffered_when_back": False}
    monkeypatch.setattr(train_module, "EventPublisher", restarted_mid_publish(kafka_broker, settings, state))
    monkeypatch.setattr(train_module, "TrainingLoop", functools.partial(TrainingLoop, retry_backoff_s=(0.2, 1.0)))
    try:
        assert (
            await asyncio.wait_for(
                run_trainer(options(settings, run_dir, steps=1), TASKS, None, backend=RecordingBackend()), 180
            )
            == []
        )
    finally:
        await asyncio.to_thread(kafka_broker.start)  # running again for the next tests, whatever happened
    assert state["buffered_when_back"], "the broker took longer than PRODUCER_RETRY_S to restart: raise it"
    assert await versions(settings) == expected(run_dir, 1)  # read from the start: once, not twice


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
