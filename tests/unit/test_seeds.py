"""Seeds derived from named parts (fulmen.infra.seeds), each call's seed in the gateway, the dispatcher's seeds."""

from __future__ import annotations

import pytest

from fulmen.algorithm.service.dispatcher import Dispatcher
from fulmen.infra.seeds import SEED_LIMIT, derive_seed
from fulmen.producers.llm_gateway.call_seeds import CallSeeds
from fulmen.schemas.events import RolloutRequest
from fulmen.schemas.task_file import TaskSpec
from fulmen.schemas.topics import TopicKey


def test_a_derived_seed_depends_on_every_part_and_their_order_and_is_stable() -> None:
    assert derive_seed(1, "train", 0, 0) == derive_seed(1, "train", 0, 0)
    assert derive_seed(1, 2) != derive_seed(2, 1) and derive_seed(1, 2) != derive_seed("1", 2)
    assert derive_seed(12, 3) != derive_seed(1, 23)  # parts are separated, not concatenated
    seeds = {derive_seed(0, "train", group, member) for group in range(100) for member in range(8)}
    assert len(seeds) == 800 and all(0 <= s < SEED_LIMIT for s in seeds)
    assert derive_seed(7, "a") == 1369390210672473032  # the same on every machine and Python version


def test_call_seeds_number_each_rollout_attempts_calls_and_forget_the_oldest() -> None:
    seeds = CallSeeds(capacity=2)
    first = [seeds.next("r1", 1, 5) for _ in range(3)]
    assert first == [derive_seed(5, 1, n) for n in range(3)]
    assert seeds.next("r1", 2, 5) == derive_seed(5, 2, 0)  # a retry starts its own numbering
    seeds.next("r2", 1, 5)  # r1 attempt 1 is now the least recently used of three: forgotten
    assert seeds.next("r1", 1, 5) == derive_seed(5, 1, 0)
    with pytest.raises(ValueError):
        CallSeeds(capacity=0)


def test_a_request_seed_must_fit_in_63_bits() -> None:
    base = {"task_id": "t", "group_id": "g", "input": {}}
    assert RolloutRequest(**base, seed=SEED_LIMIT - 1).seed == SEED_LIMIT - 1
    for bad in (-1, SEED_LIMIT):
        with pytest.raises(ValueError):
            RolloutRequest(**base, seed=bad)


class _Publisher:
    def __init__(self) -> None:
        self.requests: list[RolloutRequest] = []

    async def publish_many(self, key: TopicKey, events: list[object]) -> None:
        if key is TopicKey.TASKS:
            self.requests += events  # type: ignore[arg-type]


async def test_the_dispatcher_gives_each_rollout_a_seed_that_a_rerun_gives_again() -> None:
    tasks = [TaskSpec(task_id=f"t{i}", input={"i": i}) for i in range(3)]

    async def seeds(run_seed: int) -> list[int]:
        publisher = _Publisher()
        dispatcher = Dispatcher(
            publisher,
            tasks,  # type: ignore[arg-type]
            group_size=4,
            max_in_flight=3,
            shuffle=True,
            seed=run_seed,
        )
        await dispatcher.fill(0)
        return [r.seed for r in publisher.requests]

    first = await seeds(0)
    assert len(first) == 12 and len(set(first)) == 12
    assert await seeds(0) == first and await seeds(1) != first
