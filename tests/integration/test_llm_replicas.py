"""Several replicas behind one gateway, with a real broker: three vLLM stand-ins (one killed under load; a version
rolled over them through the models topic; one restarted), and two in-process copies of the tiny model.

What every test checks in the spans on Kafka: each call answered once, one span per call (none lost, none twice),
and the version each span records is the one that produced its answer (the stand-in writes which weights did).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from fulmen.infra.settings import FulmenSettings
from fulmen.producers.llm_gateway import LlmGateway
from fulmen.schemas import ModelVersion, TopicKey, semconv
from fulmen.testing.llm_pipeline import all_published_spans, base_url, llm_gateway_running
from fulmen.testing.publishing import event_publisher
from fulmen.testing.vllm_standin import BASE_MODEL, VllmStandIn

pytestmark = [pytest.mark.integration, pytest.mark.scale]


@asynccontextmanager
async def standins(count: int, root: Path, **options: Any) -> AsyncIterator[list[VllmStandIn]]:
    servers = [VllmStandIn(root=str(root), **options) for _ in range(count)]
    try:
        for server in servers:
            await server.start()
        yield servers
    finally:
        for server in servers:
            await server.stop()


def vllm_options(servers: list[VllmStandIn], **llm: Any) -> dict[str, Any]:
    return {
        "backend": "vllm",
        "upstream_url": ",".join(s.url for s in servers),
        "model_version": 0,
        "replica_retry_s": 0.2,
        "replica_retry_max_s": 1.0,
        **llm,
    }


async def agent(
    gateway: LlmGateway,
    rollout_id: str | None,
    calls: int,
    pause_s: float = 0.0,
    until: asyncio.Event | None = None,
) -> list[str]:
    """``calls`` chat calls one after the other (a rollout when ``rollout_id`` is given); the answers. With
    ``until``, the calls go on until it is set and then make three more: load that spans the event however slow
    the machine is."""
    client = AsyncOpenAI(base_url=base_url(gateway, rollout_id), api_key="x", max_retries=0)
    answers: list[str] = []

    async def call() -> None:
        marker = f"{rollout_id or 'free'}-{secrets.token_hex(4)}-{len(answers)}"
        reply = await client.chat.completions.create(model="fulmen", messages=[{"role": "user", "content": marker}])
        text = reply.choices[0].message.content or ""
        assert text.startswith(f"{marker} | "), (marker, text)  # its own answer
        answers.append(text)
        await asyncio.sleep(pause_s)

    for _ in range(calls):
        await call()
    if until is not None:
        while not until.is_set():
            await call()
        for _ in range(3):
            await call()
    return answers


def served_version(answer: str) -> int:
    """The version the stand-in's weights had when it wrote ``answer`` ("... | weights 3"; "default" is 0)."""
    label = answer.rsplit("| weights ", 1)[1]
    return 0 if label == "default" else int(label)


def check_one_span_per_answer(spans: list[dict[str, Any]], answers: list[str]) -> None:
    outputs = [json.loads(s["attributes"][semconv.GEN_AI_OUTPUT_MESSAGES])[0]["content"] for s in spans]
    assert len(spans) == len(answers) and Counter(outputs) == Counter(answers)  # none lost, none twice
    for span, output in zip(spans, outputs, strict=True):
        assert span["attributes"][semconv.MODEL_VERSION] == served_version(output), output


async def test_three_replicas_one_killed_under_load_lose_no_call_and_answer_none_twice(
    settings: FulmenSettings, tmp_path: Path
) -> None:
    async with (
        standins(3, tmp_path, delay_s=0.05) as servers,
        llm_gateway_running(settings, BASE_MODEL, **vllm_options(servers, follow_models=False)) as gateway,
    ):
        rollouts = [asyncio.create_task(agent(gateway, f"r{i}", 6)) for i in range(12)]
        free = [asyncio.create_task(agent(gateway, None, 3)) for _ in range(6)]
        async with asyncio.timeout(30):
            while servers[1].generating < 2:  # kill it with calls in flight on it
                await asyncio.sleep(0.005)
        await servers[1].kill()
        answers = [a for task in rollouts + free for a in await task]
        router = gateway.backend
        assert router.failovers >= 1 and gateway.stats.errors == 0
    spans = await all_published_spans(settings)
    check_one_span_per_answer(spans, answers)
    assert len(answers) == 12 * 6 + 6 * 3
    killed = servers[1].url
    by_rollout: dict[str, list[str]] = defaultdict(list)
    for span in spans:
        if semconv.ROLLOUT_ID in span["attributes"]:
            by_rollout[span["attributes"][semconv.ROLLOUT_ID]].append(span["attributes"][semconv.LLM_REPLICA])
    for rollout, replicas in by_rollout.items():  # sticky: one replica, or the killed one and then one other
        assert len(set(replicas) - {killed}) == 1, (rollout, replicas)
        if killed in replicas:
            assert replicas[: replicas.count(killed)] == [killed] * replicas.count(killed)


async def test_a_version_rolls_over_three_replicas_under_load_and_reaches_a_restarted_one(
    settings: FulmenSettings, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "v1"
    checkpoint.mkdir()
    async with (
        standins(3, tmp_path, delay_s=0.02, load_delay_s=0.2) as servers,
        event_publisher(settings) as publisher,
        llm_gateway_running(settings, BASE_MODEL, **vllm_options(servers)) as gateway,
    ):
        swapped = asyncio.Event()
        load = [asyncio.create_task(agent(gateway, f"r{i}", 5, pause_s=0.01, until=swapped)) for i in range(8)]
        await asyncio.sleep(0.3)
        await publisher.publish(TopicKey.MODELS, ModelVersion(model_name="fulmen", version=1, uri=str(checkpoint)))
        async with asyncio.timeout(30):
            while gateway.backend.model_version != 1:
                assert all(s.label in ("default", "1") for s in servers)
                await asyncio.sleep(0.005)
        assert [s.label for s in servers] == ["1", "1", "1"]  # announced once every replica confirmed
        swapped.set()
        answers = [a for task in load for a in await task]
        assert {served_version(a) for a in answers} == {0, 1}  # the swap happened under load
        # A replica that restarts comes back with its start-up weights; it gets version 1 before it serves again.
        await servers[2].kill()
        await servers[2].start()
        answers += await agent(gateway, None, 12)
        async with asyncio.timeout(30):
            while servers[2].label != "1":
                answers += await agent(gateway, None, 1)
        answers += await agent(gateway, None, 6)
        assert gateway.stats.errors == 0
    spans = await all_published_spans(settings)
    check_one_span_per_answer(spans, answers)
    assert served_version(answers[-1]) == 1
    for server in servers[:2]:  # weights replaced only with no call of this gateway on them
        paths = [path for _, path, _ in server.requests]
        pause, resume = paths.index("/pause?mode=wait&clear_cache=true"), paths.index("/resume")
        assert "/collective_rpc" in paths[pause:resume]
        assert not any(path.startswith("/v1/chat") for path in paths[pause:resume])


async def test_two_in_process_replicas_share_calls_and_swap_together(
    settings: FulmenSettings, tiny_model: Path, tmp_path: Path
) -> None:
    from fulmen.algorithm.tiny_model import TinyModelConfig, build_tiny_model

    other = build_tiny_model(tmp_path / "v1", TinyModelConfig(seed=7))  # other weights: other greedy answers
    async with (
        event_publisher(settings) as publisher,
        llm_gateway_running(settings, tiny_model, model_version=0, replicas=2, device="cpu") as gateway,
    ):
        ask = {
            "model": "fulmen",
            "messages": [{"role": "user", "content": "Say something"}],
            "temperature": 0,
            "max_tokens": 4,
            "logprobs": True,
        }
        clients = {r: AsyncOpenAI(base_url=base_url(gateway, r), api_key="x", max_retries=0) for r in "abcd"}
        before = await asyncio.gather(*(clients[r].chat.completions.create(**ask) for r in "abcd" for _ in range(2)))
        await publisher.publish(TopicKey.MODELS, ModelVersion(model_name="fulmen", version=1, uri=str(other)))
        async with asyncio.timeout(60):
            while gateway.backend.model_version != 1:
                await asyncio.sleep(0.05)
        assert [version for _, _, version in gateway.backend.states()] == [1, 1]
        after = await asyncio.gather(*(clients[r].chat.completions.create(**ask) for r in "abcd"))
    first = [a.choices[0].logprobs.content[0].logprob for a in before]
    assert max(first) - min(first) < 1e-4  # both copies have the same weights
    changed = [a.choices[0].logprobs.content[0].logprob for a in after]
    assert all(abs(lp - first[0]) > 1e-3 for lp in changed)  # the new weights answer, on both copies
    assert {a.system_fingerprint for a in after} == {"fulmen-v1"}
    spans = await all_published_spans(settings)
    assert len(spans) == 12
    replicas: dict[str, set[str]] = defaultdict(set)
    for span in spans:
        replicas[span["attributes"][semconv.ROLLOUT_ID]].add(span["attributes"][semconv.LLM_REPLICA])
    assert all(len(labels) == 1 for labels in replicas.values())  # each rollout on one replica
    assert set().union(*replicas.values()) == {"transformers#0@cpu", "transformers#1@cpu"}  # both used
    assert [s["attributes"][semconv.MODEL_VERSION] for s in spans[-4:]] == [1, 1, 1, 1]


@pytest.mark.gpu
@pytest.mark.skipif(
    not (os.environ.get("FULMEN_TEST_VLLM_URL") and os.environ.get("FULMEN_TEST_VLLM_CHECKPOINT")),
    reason="needs a real vLLM >= 0.33 OpenAI server on a GPU started with VLLM_SERVER_DEV_MODE=1 (vllm wheels are "
    "CUDA-only): set FULMEN_TEST_VLLM_URL=http://host:port/v1, FULMEN_TEST_VLLM_MODEL and "
    "FULMEN_TEST_VLLM_CHECKPOINT (a checkpoint directory of that model the server can read)",
)
async def test_real_vllm_loads_a_version_and_each_call_records_it(settings: FulmenSettings) -> None:
    url, model = os.environ["FULMEN_TEST_VLLM_URL"], os.environ.get("FULMEN_TEST_VLLM_MODEL", "")
    checkpoint = os.environ["FULMEN_TEST_VLLM_CHECKPOINT"]
    options = {"backend": "vllm", "upstream_url": url, "model_version": 0}
    async with event_publisher(settings) as publisher, llm_gateway_running(settings, model, **options) as gateway:
        version = 1 + (gateway.backend.model_version or 0)
        await publisher.publish(TopicKey.MODELS, ModelVersion(model_name="fulmen", version=version, uri=checkpoint))
        async with asyncio.timeout(600):
            while gateway.backend.model_version != version:
                await asyncio.sleep(0.5)
        client = AsyncOpenAI(base_url=base_url(gateway, "r-real"), api_key="x", max_retries=0)
        await client.chat.completions.create(
            model="fulmen", messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0
        )
    [span] = await all_published_spans(settings)
    assert span["attributes"][semconv.MODEL_VERSION] == version  # what vLLM's weight_versions said
