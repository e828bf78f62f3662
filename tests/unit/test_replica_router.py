"""The router over replicas, with replicas faked at its edge: stickiness, load, failover, probes, rolling swaps."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from fulmen.producers.llm_gateway.backends.base import (
    CallResult,
    Choice,
    ReplicaUnavailableError,
    VersionRefusedError,
)
from fulmen.producers.llm_gateway.backends.router import ReplicaRouter, ReplicaState
from fulmen.producers.llm_gateway.protocol import ApiError, ChatRequest, CompletionRequest, parse_chat
from fulmen.producers.llm_gateway.settings import LlmSection
from fulmen.schemas import ModelVersion

pytestmark = pytest.mark.scale

OPTIONS = LlmSection(replica_retry_s=0.05, replica_retry_max_s=0.2, replica_wait_s=5)


class FakeReplica:
    """A replica that takes ``delay_s`` a call, can be dead, and loads versions in place or beside."""

    name = "fake"

    def __init__(self, label: str, *, in_place: bool = False, delay_s: float = 0.02) -> None:
        self.label = label
        self.in_place = in_place
        self.delay_s = delay_s
        self.version: int | None = 0
        self.dead = False
        self.refuse = False
        self.served: list[tuple[str, int | None]] = []  # (marker, version) of each call answered
        self.in_flight = 0
        self.loading = False
        self.adapters: dict[str, int] = {}  # per agent, its adapter's version

    @property
    def model_version(self) -> int | None:
        return self.version

    @property
    def context_length(self) -> int | None:
        return 2048

    def adapter_version(self, agent: str) -> int | None:
        return self.adapters.get(agent)

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def chat(self, request: ChatRequest) -> CallResult:
        if self.dead:
            raise ApiError(503, f"{self.label} cannot be reached", kind="upstream_unavailable")
        if self.in_place and self.loading:
            raise AssertionError(f"a call reached {self.label} while its weights were replaced")
        version, marker = self.version, request.messages[-1]["content"]
        self.in_flight += 1
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        if self.dead:  # died while the call was in flight: nothing came back
            raise ApiError(503, f"{self.label}: connection reset", kind="upstream_unavailable")
        self.served.append((marker, version))
        choice = Choice(0, marker, "stop", [1], [-0.1])
        return CallResult(secrets.token_hex(4), "m", [choice], [1], 1, 1, model_version=version)

    async def complete(self, request: CompletionRequest) -> CallResult:
        raise NotImplementedError

    async def probe(self) -> None:
        if self.dead:
            raise ReplicaUnavailableError(f"{self.label} is down")

    def swaps_in_place(self, event: ModelVersion) -> bool:
        return self.in_place

    async def load_version(self, event: ModelVersion) -> None:
        if self.dead:
            raise ReplicaUnavailableError(f"{self.label} is down")
        if self.in_place and self.in_flight:
            raise AssertionError(f"{self.label} was not drained before an in-place load")
        self.loading = True
        try:
            await asyncio.sleep(0.05)
        finally:
            self.loading = False
        if self.refuse:
            raise VersionRefusedError(f"{self.label} refuses {event.uri}")
        if event.adapter:
            self.adapters[event.adapter] = event.version
        else:
            self.version = event.version


def ask(marker: str) -> ChatRequest:
    return parse_chat({"model": "m", "messages": [{"role": "user", "content": marker}]}, 1)


def version(number: int) -> ModelVersion:
    return ModelVersion(model_name="m", version=number, uri=f"/ckpt/{number}")


async def running(replicas: list[FakeReplica], **options: object) -> ReplicaRouter:
    router = ReplicaRouter(replicas, OPTIONS.model_copy(update=options))
    await router.start()
    return router


async def test_a_rollouts_calls_stick_to_one_replica_and_the_rest_go_to_the_least_loaded() -> None:
    replicas = [FakeReplica(f"r{i}") for i in range(3)]
    router = await running(replicas)
    try:
        for rollout in ("a", "b", "c", "d"):
            for call in range(3):
                await router.chat(ask(f"{rollout}{call}"), affinity=rollout)
        await asyncio.gather(*(router.chat(ask(f"free{i}")) for i in range(6)))
    finally:
        await router.close()
    by_replica = {r.label: {marker for marker, _ in r.served} for r in replicas}
    for rollout in ("a", "b", "c", "d"):
        holders = [label for label, markers in by_replica.items() if f"{rollout}0" in markers]
        assert len(holders) == 1 and {f"{rollout}1", f"{rollout}2"} <= by_replica[holders[0]]
    rollouts_per_replica = sorted(sum(f"{r}0" in markers for r in "abcd") for markers in by_replica.values())
    assert rollouts_per_replica == [1, 1, 2]  # each new rollout went to a least loaded replica, in turn
    free = sorted(sum(m.startswith("free") for m in markers) for markers in by_replica.values())
    assert free == [2, 2, 2]  # six concurrent calls: two on each


async def test_a_replica_that_dies_under_load_loses_no_call_and_answers_none_twice() -> None:
    replicas = [FakeReplica(f"r{i}", delay_s=0.03) for i in range(3)]
    router = await running(replicas)
    markers = [f"rollout{i}-call{j}" for i in range(12) for j in range(6)]
    try:
        clients = [asyncio.create_task(rollout(router, f"rollout{i}", 6)) for i in range(12)]
        await asyncio.sleep(0.05)
        replicas[1].dead = True  # its calls in flight fail; new ones find it down
        results = [result for client in clients for result in await client]
        assert router.states()[1][1] is ReplicaState.DOWN  # probed every 0.05-0.2 s, and still dead
        replicas[1].dead = False  # back: the next probe puts it in again
        async with asyncio.timeout(5):
            while router.states()[1][1] is not ReplicaState.UP:
                await asyncio.sleep(0.02)
    finally:
        await router.close()
    assert [r.choices[0].text for r in results] == markers  # every call answered, with its own answer
    served = [marker for replica in replicas for marker, _ in replica.served]
    assert sorted(served) == sorted(markers)  # and served exactly once
    assert router.failovers > 0
    assert {r.replica for r in results if r.choices[0].text in {m for m, _ in replicas[1].served}} == {"r1"}
    assert len(replicas[1].served) < len(markers) // 3  # it served until it died, and not after


async def rollout(router: ReplicaRouter, rollout_id: str, calls: int) -> list[CallResult]:
    """An agent: ``calls`` calls one after the other, tied to one rollout."""
    return [await router.chat(ask(f"{rollout_id}-call{j}"), affinity=rollout_id) for j in range(calls)]


async def test_an_error_of_the_request_is_not_retried_elsewhere() -> None:
    replicas = [FakeReplica(f"r{i}") for i in range(2)]

    async def refuse(request: ChatRequest) -> CallResult:
        raise ApiError(400, "prompt too long", param="messages")

    replicas[0].chat = refuse  # type: ignore[method-assign]
    replicas[1].chat = refuse  # type: ignore[method-assign]
    router = await running(replicas)
    try:
        with pytest.raises(ApiError) as refused:
            await router.chat(ask("x"))
    finally:
        await router.close()
    assert refused.value.status == 400
    assert [state for _, state, _ in router.states()] == [ReplicaState.UP, ReplicaState.UP]


async def test_with_every_replica_down_a_call_is_a_503_at_once() -> None:
    replicas = [FakeReplica("r0"), FakeReplica("r1")]
    for replica in replicas:
        replica.dead = True
    router = await running(replicas, replica_retry_s=30, replica_retry_max_s=30)
    try:
        assert [state for _, state, _ in router.states()] == [ReplicaState.DOWN] * 2  # found down at start
        with pytest.raises(ApiError) as unavailable:
            await asyncio.wait_for(router.chat(ask("x")), 1)
    finally:
        await router.close()
    assert unavailable.value.status == 503 and unavailable.value.headers["Retry-After"] == "1"
    assert "r0: upstream" not in unavailable.value.message and "r0" in unavailable.value.message


async def test_an_in_place_swap_rolls_one_replica_at_a_time_and_calls_finish_on_their_version() -> None:
    replicas = [FakeReplica(f"r{i}", in_place=True, delay_s=0.03) for i in range(3)]
    router = await running(replicas)
    draining_at_once: list[int] = []

    async def watch() -> None:
        while True:
            draining_at_once.append(sum(state is ReplicaState.DRAINING for _, state, _ in router.states()))
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    try:
        clients = [asyncio.create_task(rollout(router, f"rollout{i}", 10)) for i in range(9)]
        await asyncio.sleep(0.02)
        assert router.model_version == 0
        await router.load_version(version(1))
        assert router.model_version == 1  # announced once every replica confirmed
        results = [result for client in clients for result in await client]
        after = await router.chat(ask("after"))
    finally:
        watcher.cancel()
        await router.close()
    assert max(draining_at_once) == 1  # the other two kept serving
    assert len(results) == 90 and after.model_version == 1
    for replica in replicas:  # each call reported the version of the weights that served it
        assert {v for _, v in replica.served} <= {0, 1}
    assert {r.model_version for r in results} == {0, 1}


async def test_a_single_replica_swapping_in_place_makes_calls_wait_not_fail() -> None:
    replica = FakeReplica("only", in_place=True)
    router = await running([replica])
    try:
        swap = asyncio.create_task(router.load_version(version(1)))
        await asyncio.sleep(0.01)
        assert router.states()[0][1] is ReplicaState.DRAINING
        result = await router.chat(ask("during"))
        await swap
    finally:
        await router.close()
    assert result.model_version == 1  # it waited for the new weights


async def test_a_refused_version_leaves_that_replica_on_its_old_one_and_is_not_announced() -> None:
    replicas = [FakeReplica(f"r{i}") for i in range(3)]
    replicas[2].refuse = True
    router = await running(replicas)
    try:
        with pytest.raises(VersionRefusedError, match="serves on 2 of 3 replicas; r2 refused it"):
            await router.load_version(version(1))
        assert router.model_version == 0  # not every live replica serves 1
        results = await asyncio.gather(*(router.chat(ask(f"c{i}")) for i in range(9)))
    finally:
        await router.close()
    assert {r.replica: r.model_version for r in results} == {"r0": 1, "r1": 1, "r2": 0}


async def test_a_replica_that_was_down_during_a_swap_gets_the_version_before_it_serves_again() -> None:
    replicas = [FakeReplica(f"r{i}", in_place=True) for i in range(2)]
    router = await running(replicas)
    try:
        replicas[1].dead = True
        await asyncio.gather(*(router.chat(ask(f"c{i}")) for i in range(4)))  # finds r1 dead
        await router.load_version(version(3))
        assert router.model_version == 3 and replicas[1].version == 0
        replicas[1].dead = False
        async with asyncio.timeout(5):
            while router.states()[1][1] is not ReplicaState.UP:
                await asyncio.sleep(0.02)
        results = await asyncio.gather(*(router.chat(ask(f"d{i}")) for i in range(6)))
    finally:
        await router.close()
    assert replicas[1].version == 3
    assert {r.replica for r in results} == {"r0", "r1"} and {r.model_version for r in results} == {3}


async def test_a_replica_found_serving_another_version_is_brought_back_to_the_target() -> None:
    replicas = [FakeReplica(f"r{i}") for i in range(2)]
    router = await running(replicas)
    try:
        await router.load_version(version(2))
        replicas[0].version = 0  # restarted with its start-up weights, unnoticed until a call says so
        first = await router.chat(ask("first"))
        assert first.replica == "r0" and first.model_version == 0  # what really served it
        async with asyncio.timeout(5):
            while replicas[0].version != 2 or router.states()[0][1] is not ReplicaState.UP:
                await asyncio.sleep(0.02)
        results = await asyncio.gather(*(router.chat(ask(f"c{i}")) for i in range(4)))
    finally:
        await router.close()
    assert {r.model_version for r in results} == {2} and {r.replica for r in results} == {"r0", "r1"}


def test_upstream_urls_are_replicas_and_mistakes_fail_at_start_up() -> None:
    from fulmen.producers.llm_gateway.backends import build_backend
    from fulmen.schemas.errors import ConfigurationError

    urls = " http://a:8001/v1/, http://b:8001/v1,http://c:8001/v1 "
    router = build_backend(LlmSection(backend="vllm", model="m", upstream_url=urls))
    assert isinstance(router, ReplicaRouter) and router.name == "vllm"
    assert [label for label, _, _ in router.states()] == ["http://a:8001/v1", "http://b:8001/v1", "http://c:8001/v1"]
    with pytest.raises(ConfigurationError, match="listed twice"):
        build_backend(LlmSection(backend="openai", upstream_url="http://a/v1,http://a/v1"))
    with pytest.raises(ConfigurationError, match="FULMEN_LLM_REPLICAS is for the transformers backend"):
        build_backend(LlmSection(backend="vllm", upstream_url="http://a/v1", replicas=2))
    with pytest.raises(ConfigurationError, match="needs the upstream's /v1 URL"):
        build_backend(LlmSection(backend="vllm", upstream_url=" , "))


@pytest.mark.multiagent
async def test_an_agents_adapter_loads_on_every_replica_beside_the_model_and_after_a_replica_comes_back() -> None:
    """Adapters load at once everywhere (never drained, even beside in-place weights); one that was down gets the
    model's target and then every adapter before it serves again; the router announces an adapter's version once
    every live replica has it."""
    replicas = [FakeReplica("r0", in_place=True), FakeReplica("r1", in_place=True)]
    router = await running(replicas)
    adapter = ModelVersion(model_name="m", version=4, uri="/ckpt/4/write", format="hf_lora_adapter", adapter="write")
    try:
        replicas[1].dead = True
        router._take_out(router.slots[1], "dead")  # as a failed call does
        await router.load_version(version(3))
        await router.load_version(adapter)
        assert replicas[0].adapters == {"write": 4} and replicas[1].adapters == {}
        assert router.adapter_version("write") == 4  # the live replica has it
        replicas[1].dead = False
        async with asyncio.timeout(5):
            while router.states()[1][1] is not ReplicaState.UP:
                await asyncio.sleep(0.02)
        assert replicas[1].version == 3 and replicas[1].adapters == {"write": 4}
        assert router.adapter_version("write") == 4 and router.adapter_version("check") is None
    finally:
        await router.close()
