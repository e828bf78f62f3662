"""Crash safety of the trainer (kill -9 chaos findings): a model version the broker did not acknowledge is
retried, never lost, and never sent twice (not even while its first record is still in the producer's buffer);
a stop during an outage is honoured within seconds; a resumed run does not republish the base model as its
version; a checkpoint save killed midway leaves nothing that the next start would load."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from aiokafka.errors import KafkaConnectionError
from aiokafka.structs import RecordMetadata, TopicPartition

from fulmen.algorithm.service.loop import STOP_GRACE_S
from fulmen.algorithm.service.run import latest_checkpoint
from fulmen.algorithm.tiny_model import TinyModelConfig, build_tiny_model
from fulmen.infra.kafka.publish import EventPublisher
from fulmen.schemas.errors import BrokerUnavailableError
from fulmen.schemas.events import ModelVersion
from fulmen.schemas.topics import TopicKey
from tests.fakes import FakeBroker
from tests.unit.test_train_loop import FakePublisher, build, run

pytestmark = pytest.mark.security

TINY = TinyModelConfig(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64
)


class FlakyModels:
    """Wraps the fake publisher: the first ``failures`` model-version publishes raise the broker's timeout
    error; with ``written`` the record reaches the topic all the same (only the acknowledgement was lost); with
    ``buffered`` it stays in the producer's buffer and lands later: when the caller settles the publisher, else
    ahead of the next record sent (the producer sends its older batch first)."""

    def __init__(
        self,
        inner: FakePublisher,
        failures: int,
        *,
        written: bool = False,
        buffered: bool = False,
        stop: asyncio.Event | None = None,
    ) -> None:
        self.inner, self.failures, self.written, self.buffered, self.stop = inner, failures, written, buffered, stop
        self.attempts = 0
        self.buffer: list[ModelVersion] = []

    async def publish(self, key: TopicKey, event) -> None:
        await self.publish_many(key, [event])

    async def settle(self) -> None:
        await self._land()

    async def _land(self) -> None:
        landed, self.buffer = self.buffer, []
        await self.inner.publish_many(TopicKey.MODELS, landed)

    async def publish_many(self, key: TopicKey, events) -> None:
        events = list(events)
        await self._land()
        if key is TopicKey.MODELS and self.failures:
            self.failures -= 1
            self.attempts += 1
            if self.written:
                await self.inner.publish_many(key, events)
            elif self.buffered:
                self.buffer.extend(events)
            if self.stop is not None and self.attempts >= 2:
                self.stop.set()  # SIGTERM while the broker is down
            raise BrokerUnavailableError("publishing to fulmen.models failed: no acknowledgement within 30s")
        await self.inner.publish_many(key, events)


def flaky(loop, publisher: FakePublisher, failures: int, **options) -> FlakyModels:
    wrapper = FlakyModels(publisher, failures, **options)
    loop.publisher = wrapper
    loop.retry_backoff_s = (0.01, 0.02)
    return wrapper


def versions(publisher: FakePublisher) -> list[tuple[int, str]]:
    return [(v.version, Path(v.uri).name) for v in publisher.events[TopicKey.MODELS]]


def test_a_version_the_broker_did_not_acknowledge_is_retried_until_it_is(tmp_path: Path) -> None:
    loop, publisher, _, _ = build(tmp_path, steps=2)
    flaky(loop, publisher, failures=3)
    steps = run(loop)
    assert [s.step for s in steps] == [1, 2]
    assert versions(publisher) == [(1, "v1"), (2, "v2")]  # each exactly once


def test_a_retry_does_not_resend_a_version_whose_first_attempt_was_written(tmp_path: Path) -> None:
    loop, publisher, _, _ = build(tmp_path, steps=2)
    flaky(loop, publisher, failures=1, written=True)

    async def on_topic(event: ModelVersion) -> bool:
        return any(v.version == event.version and v.run_id == event.run_id for v in publisher.events[TopicKey.MODELS])

    loop.version_published = on_topic
    assert [s.step for s in run(loop)] == [1, 2]
    assert versions(publisher) == [(1, "v1"), (2, "v2")]


def on_topic(publisher: FakePublisher):
    async def check(event: ModelVersion) -> bool:
        return any(v.version == event.version and v.run_id == event.run_id for v in publisher.events[TopicKey.MODELS])

    return check


def test_a_retry_waits_for_the_first_record_to_leave_the_producers_buffer_before_looking_for_it(
    tmp_path: Path,
) -> None:
    loop, publisher, _, _ = build(tmp_path, steps=2)
    flaky(loop, publisher, failures=1, buffered=True)  # the first v1 is still buffered when the retry begins
    loop.version_published = on_topic(publisher)
    assert [s.step for s in run(loop)] == [1, 2]
    assert versions(publisher) == [(1, "v1"), (2, "v2")]  # not (1, "v1") twice


class Unanswered(FlakyModels):
    """A broker gone for good, and a SIGTERM during the outage: ``stop`` is set as a wait for the broker begins,
    a wait of 60 s (as the real publisher waits out its timeout). The wait is in the publish itself, or (``in_settle``)
    in settling the publisher: the publish fails at once and its record stays buffered."""

    def __init__(self, inner: FakePublisher, stop: asyncio.Event, *, in_settle: bool) -> None:
        super().__init__(inner, failures=10**6, buffered=True)
        self.stop_event, self.in_settle = stop, in_settle

    async def publish_many(self, key: TopicKey, events) -> None:
        if key is TopicKey.MODELS and not self.in_settle:
            await self._outage()
        await super().publish_many(key, events)

    async def settle(self) -> None:
        if self.buffer:
            await self._outage()

    async def _outage(self) -> None:
        self.stop_event.set()
        await asyncio.sleep(60)
        raise BrokerUnavailableError("publishing to fulmen.models failed: no acknowledgement within 60s")


@pytest.mark.parametrize("in_settle", [False, True], ids=["waiting-for-the-ack", "waiting-for-the-buffer"])
def test_stop_is_honoured_within_seconds_while_an_attempt_waits_for_the_broker(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, in_settle: bool
) -> None:
    loop, publisher, _, source = build(tmp_path, steps=2)
    stop = asyncio.Event()
    loop.publisher = Unanswered(publisher, stop, in_settle=in_settle)  # type: ignore[assignment]
    loop.retry_backoff_s = (0.01, 0.02)
    assert STOP_GRACE_S <= 5  # "within seconds": the default grace is what is tested here
    assert asyncio.run(asyncio.wait_for(loop.run(stop), STOP_GRACE_S + 8)) == []  # not after the 60 s wait
    assert publisher.events[TopicKey.MODELS] == [] and loop.version == 0 and source.committed == {}
    assert "unpublished" in caplog.text


class BufferingProducer:
    """The producer as the publisher sees it: ``send`` buffers the record and returns its delivery future, which
    the test resolves (the broker acknowledged) or fails; with ``answering`` it is acknowledged at once."""

    def __init__(self, *, answering: bool = False) -> None:
        self.answering = answering
        self.sent: list[asyncio.Future[RecordMetadata]] = []

    async def send(self, topic: str, value: bytes, key: bytes, headers=None) -> asyncio.Future[RecordMetadata]:
        future: asyncio.Future[RecordMetadata] = asyncio.get_running_loop().create_future()
        if self.answering:
            future.set_result(acknowledged(topic, len(self.sent)))
        self.sent.append(future)
        return future


def acknowledged(topic: str, offset: int) -> RecordMetadata:
    return RecordMetadata(topic, 0, TopicPartition(topic, 0), offset, -1, 0, 0)


def test_the_publisher_settles_a_publish_that_timed_out_or_was_cancelled_once_its_record_left_the_buffer() -> None:
    async def scenario() -> None:
        kafka = BufferingProducer()
        publisher = EventPublisher(FakeBroker(kafka), timeout_s=0.2)
        await publisher.settle()  # nothing unacknowledged: at once
        with pytest.raises(BrokerUnavailableError, match="no acknowledgement within 0.2s"):
            await publisher.publish(TopicKey.MODELS, ModelVersion(model_name="m", version=1, uri="a"))
        [first] = kafka.sent
        assert not first.done()  # still buffered, not cancelled: the producer may deliver it later
        with pytest.raises(BrokerUnavailableError, match=r"1 record\(s\) sent earlier to fulmen.models still"):
            await publisher.settle()
        cancelled = asyncio.create_task(
            publisher.publish(TopicKey.MODELS, ModelVersion(model_name="m", version=2, uri="b"))
        )
        await asyncio.sleep(0.05)
        cancelled.cancel()  # e.g. the loop's stop
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        second = kafka.sent[1]
        assert not second.done()
        first.set_result(acknowledged("fulmen.models", 0))  # the broker is back: the first lands late
        with pytest.raises(BrokerUnavailableError, match=r"1 record\(s\)"):
            await publisher.settle()  # the second is still buffered
        second.set_exception(KafkaConnectionError("gone for good"))  # fails: it can no longer land
        await publisher.settle()
        kafka.answering = True
        [metadata] = await publisher.publish_many(TopicKey.MODELS, [ModelVersion(model_name="m", version=3, uri="c")])
        assert metadata.offset == 2 and len(kafka.sent) == 3  # the normal path: one send, acknowledged
        await publisher.settle()

    asyncio.run(scenario())


def test_stop_during_an_outage_ends_cleanly_with_the_version_saved_but_unpublished(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loop, publisher, _, source = build(tmp_path, steps=2)
    stop = asyncio.Event()
    flaky(loop, publisher, failures=10**6, stop=stop)
    assert run(loop, stop) == []
    assert publisher.events[TopicKey.MODELS] == [] and publisher.events[TopicKey.METRICS] == []
    assert (tmp_path / "checkpoints" / "v1").is_dir() and loop.version == 0
    assert source.committed == {}  # the step's transitions are redelivered, not lost
    assert "unpublished" in caplog.text and "publishes it" in caplog.text


def test_a_resumed_run_publishes_its_missing_checkpoint_version_once(tmp_path: Path) -> None:
    loop, publisher, _, _ = build(tmp_path, initial_version=4, steps=4)

    async def on_topic(event: ModelVersion) -> bool:
        return any(v.version == event.version for v in publisher.events[TopicKey.MODELS])

    loop.version_published = on_topic
    assert asyncio.run(loop.publish_resumed(asyncio.Event()))
    assert asyncio.run(loop.publish_resumed(asyncio.Event()))  # a second restart: already there
    [event] = publisher.events[TopicKey.MODELS]
    assert (event.version, event.uri, event.step, event.run_id, event.base_model, event.format) == (
        4,
        str(tmp_path / "checkpoints" / "v4"),
        4,
        "r1",
        "base",
        "hf",
    )


def test_the_initial_version_is_published_only_when_starting_from_the_base_model(tmp_path: Path) -> None:
    loop, publisher, _, _ = build(tmp_path / "fresh", steps=1, publish_initial_version=True)
    run(loop)
    assert [(v.version, v.uri) for v in publisher.events[TopicKey.MODELS]] == [
        (0, "base"),
        (1, str(tmp_path / "fresh" / "checkpoints" / "v1")),
    ]
    loop, publisher, _, _ = build(tmp_path / "resumed", initial_version=2, steps=3, publish_initial_version=True)
    run(loop)
    assert [(v.version, v.uri) for v in publisher.events[TopicKey.MODELS]] == [
        (3, str(tmp_path / "resumed" / "checkpoints" / "v3"))
    ]  # version 2 is the checkpoint, never the base weights


KILLED_DURING_SAVE = """
import os, sys
from fulmen.algorithm.trainer.torch_backend import TorchTrainer, TorchTrainerConfig
trainer = TorchTrainer(TorchTrainerConfig(sys.argv[1], device="cpu", dtype="float32"))
write = trainer.model.save_pretrained
def write_then_die(directory, *args, **kwargs):
    write(directory, *args, **kwargs)  # the weights and config.json are on disk, the tokenizer is not
    os._exit(137)  # kill -9 in the middle of the save
trainer.model.save_pretrained = write_then_die
trainer.save(sys.argv[2])
"""


def test_a_save_killed_midway_leaves_no_checkpoint_to_load(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model", TINY)
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "v2").mkdir(parents=True)
    (checkpoints / "v2" / "config.json").write_text("{}")
    root = Path(__file__).resolve().parents[2]
    died = subprocess.run(
        [sys.executable, "-c", KILLED_DURING_SAVE, str(model), str(checkpoints / "v3")],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        timeout=300,
    )
    assert died.returncode == 137, died.stderr.decode()[-2000:]
    assert not (checkpoints / "v3").exists()  # only the temporary sibling was written
    assert latest_checkpoint(tmp_path / "run") == (2, checkpoints / "v2")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["v2"]  # the dead writer's leftovers are gone


def test_a_live_writers_temporary_directory_is_kept_and_a_finished_save_replaces_the_old(tmp_path: Path) -> None:
    from fulmen.algorithm.trainer.base import atomic_directory  # here, so the other tests run without it

    checkpoints = tmp_path / "checkpoints"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = checkpoints / f"v5.tmp-{sleeper.pid}"
        busy.mkdir(parents=True)
        (busy / "config.json").write_text("{}")
        assert latest_checkpoint(tmp_path) is None and busy.is_dir()  # being written: neither loaded nor removed
    finally:
        sleeper.kill()
        sleeper.wait()
    (checkpoints / "v1").mkdir()
    (checkpoints / "v1" / "old.bin").write_text("old")
    with atomic_directory(checkpoints / "v1") as staging:
        (staging / "config.json").write_text("{}")
        assert not (checkpoints / "v1" / "config.json").exists()
    assert sorted(p.name for p in (checkpoints / "v1").iterdir()) == ["config.json"]
    with pytest.raises(RuntimeError), atomic_directory(checkpoints / "v6") as staging:
        (staging / "config.json").write_text("{}")
        raise RuntimeError("the save failed")
    assert latest_checkpoint(tmp_path) == (1, checkpoints / "v1")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["v1"]  # the dead sleeper's directory went too
