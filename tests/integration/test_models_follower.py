"""The LLM gateway's model follower (a faststream subscriber, no consumer group) against a real broker."""

from __future__ import annotations

import asyncio

import pytest

from fulmen.infra.settings import FulmenSettings
from fulmen.producers.llm_gateway.models_follower import ModelsFollower
from fulmen.schemas import ModelVersion, TopicKey
from fulmen.testing.publishing import event_publisher

pytestmark = pytest.mark.integration


class Backend:
    """What the follower sees of a backend: the version it serves, and a load that records each version."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.loaded: list[int] = []

    async def load(self, event: ModelVersion) -> None:
        self.loaded.append(event.version)
        self.version = event.version


def version(number: int, model: str = "m", fmt: str = "hf") -> ModelVersion:
    return ModelVersion(model_name=model, version=number, uri=f"/ckpt/{model}/{number}", format=fmt)


async def until(condition, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.05)


async def test_an_empty_topic_is_caught_up_at_once(settings: FulmenSettings) -> None:
    backend = Backend()
    follower = ModelsFollower(settings, "m", lambda adapter: backend.version, backend.load)
    try:
        await asyncio.wait_for(follower.catch_up(), 60)
    finally:
        await follower.close()
    assert backend.loaded == []


async def test_catch_up_loads_the_newest_version_only_then_each_newer_one(settings: FulmenSettings) -> None:
    async with event_publisher(settings) as publisher:
        await publisher.publish_many(TopicKey.MODELS, [version(1), version(2), version(9, "other"), version(3)])
        backend, stop = Backend(), asyncio.Event()
        follower = ModelsFollower(settings, "m", lambda adapter: backend.version, backend.load)
        await asyncio.wait_for(follower.catch_up(), 60)
        assert backend.loaded == [3]  # read to the end first: versions 1 and 2 never loaded
        following = asyncio.create_task(follower.run(stop))
        await publisher.publish(TopicKey.MODELS, version(4))
        await until(lambda: backend.loaded == [3, 4])
        await publisher.publish_many(TopicKey.MODELS, [version(2), version(5, fmt="hf_lora_adapter"), version(6)])
        await until(lambda: backend.loaded == [3, 4, 6])  # an older version is not served; of a batch, the newest
        stop.set()
        await asyncio.wait_for(following, 30)
    # Another gateway, started later, sees every version too: no consumer group, nothing committed.
    late = Backend()
    second = ModelsFollower(settings, "m", lambda adapter: late.version, late.load)
    try:
        await asyncio.wait_for(second.catch_up(), 60)
    finally:
        await second.close()
    assert late.loaded == [6]
