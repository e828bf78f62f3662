"""``Waves``: concurrent callers' events go out together, a wave at a time, each caller answered by its wave."""

from __future__ import annotations

import asyncio

import pytest

from fulmen.infra.kafka.publish import Waves
from fulmen.schemas import TopicKey
from fulmen.schemas.errors import BrokerUnavailableError


class HeldPublisher:
    """Records each publish_many and holds it until ``release`` is set."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.release = asyncio.Event()
        self.error: Exception | None = None

    def topic_name(self, key: TopicKey) -> str:
        return key.value

    async def publish_many(self, key: TopicKey, events: list[str]) -> None:
        self.calls.append(list(events))
        await self.release.wait()
        if self.error is not None:
            raise self.error


async def test_callers_that_arrive_while_a_wave_is_out_go_together_in_the_next() -> None:
    publisher = HeldPublisher()
    waves = Waves(publisher, TopicKey.ROLLOUTS)  # type: ignore[arg-type]
    first = asyncio.create_task(waves.publish_many(["a1", "a2"]))
    await asyncio.sleep(0)
    others = [asyncio.create_task(waves.publish_many([f"{name}1", f"{name}2"])) for name in "bcd"]
    await asyncio.sleep(0)
    assert publisher.calls == [["a1", "a2"]] and not first.done()  # the others wait for the first wave
    publisher.release.set()
    await asyncio.gather(first, *others)
    assert publisher.calls == [["a1", "a2"], ["b1", "b2", "c1", "c2", "d1", "d2"]]  # each caller's in order
    assert waves.waves == 2


async def test_a_failed_wave_fails_each_of_its_callers_and_a_cancelled_caller_leaves_it_going() -> None:
    publisher = HeldPublisher()
    waves = Waves(publisher, TopicKey.ROLLOUTS)  # type: ignore[arg-type]
    callers = [asyncio.create_task(waves.publish_many([name])) for name in "xyz"]
    await asyncio.sleep(0)
    callers[0].cancel()
    await asyncio.sleep(0)
    publisher.error = BrokerUnavailableError("no acknowledgement")
    publisher.release.set()
    outcomes = await asyncio.gather(*callers, return_exceptions=True)
    assert isinstance(outcomes[0], asyncio.CancelledError)
    assert [type(o) for o in outcomes[1:]] == [BrokerUnavailableError, BrokerUnavailableError]
    assert publisher.calls == [["x", "y", "z"]]  # x's cancellation did not take the wave down


def test_a_topic_the_sender_did_not_declare_is_refused() -> None:
    class Declared(HeldPublisher):
        def topic_name(self, key: TopicKey) -> str:
            raise ValueError(f"runner publishes to rollouts, not to {key}")

    with pytest.raises(ValueError, match="not to"):
        Waves(Declared(), TopicKey.MODELS)  # type: ignore[arg-type]
