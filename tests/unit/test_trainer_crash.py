"""Crash safety of the trainer (kill -9 chaos findings): a model version the broker did not acknowledge is
retried, never lost, and never sent twice; a resumed run does not republish the base model as its version; a
checkpoint save killed midway leaves nothing that the next start would load."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from algorithm.tiny_model import TinyModelConfig, build_tiny_model
from algorithm.train import latest_checkpoint
from infra.errors import BrokerUnavailableError
from schemas.events import ModelVersion
from schemas.topics import TopicKey
from tests.unit.test_train_loop import FakePublisher, build, run

pytestmark = pytest.mark.security

TINY = TinyModelConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=64)  # fmt: skip


class FlakyModels:
    """Wraps the fake publisher: the first ``failures`` model-version publishes raise the broker's timeout
    error; with ``written`` the record reaches the topic all the same (only the acknowledgement was lost)."""

    def __init__(self, inner: FakePublisher, failures: int, *, written: bool = False,
                 stop: asyncio.Event | None = None) -> None:  # fmt: skip
        self.inner, self.failures, self.written, self.stop = inner, failures, written, stop
        self.attempts = 0

    async def publish(self, key: TopicKey, event) -> None:
        await self.publish_many(key, [event])

    async def publish_many(self, key: TopicKey, events) -> None:
        events = list(events)
        if key is TopicKey.MODELS and self.failures:
            self.failures -= 1
            self.attempts += 1
            if self.written:
                await self.inner.publish_many(key, events)
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
        4, str(tmp_path / "checkpoints" / "v4"), 4, "r1", "base", "hf"
    )  # fmt: skip


def test_the_initial_version_is_published_only_when_starting_from_the_base_model(tmp_path: Path) -> None:
    loop, publisher, _, _ = build(tmp_path / "fresh", steps=1, publish_initial_version=True)
    run(loop)
    assert [(v.version, v.uri) for v in publisher.events[TopicKey.MODELS]] == [
        (0, "base"), (1, str(tmp_path / "fresh" / "checkpoints" / "v1"))
    ]  # fmt: skip
    loop, publisher, _, _ = build(tmp_path / "resumed", initial_version=2, steps=3, publish_initial_version=True)
    run(loop)
    assert [(v.version, v.uri) for v in publisher.events[TopicKey.MODELS]] == [
        (3, str(tmp_path / "resumed" / "checkpoints" / "v3"))
    ]  # version 2 is the checkpoint, never the base weights


KILLED_DURING_SAVE = """
import os, sys
from algorithm.trainer.torch_backend import TorchTrainer, TorchTrainerConfig
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
    died = subprocess.run([sys.executable, "-c", KILLED_DURING_SAVE, str(model), str(checkpoints / "v3")], cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, timeout=300)  # fmt: skip
    assert died.returncode == 137, died.stderr.decode()[-2000:]
    assert not (checkpoints / "v3").exists()  # only the temporary sibling was written
    assert latest_checkpoint(tmp_path / "run") == (2, checkpoints / "v2")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["v2"]  # the dead writer's leftovers are gone


def test_a_live_writers_temporary_directory_is_kept_and_a_finished_save_replaces_the_old(tmp_path: Path) -> None:
    from algorithm.trainer.base import atomic_directory  # here, so the other tests run without it

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
