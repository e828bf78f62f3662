"""The LLM gateway on the llamacpp backend: a real llama-server (built by ``make install``), a real broker, the tiny
model (and SmolLM2-135M when its directory is there). What the spans record is what llama-server sampled, and its
logprobs are the trainer's.

The tiny model's server is started once for the module (on a thread's event loop, as :class:`fulmen.testing.served.Served`
runs services) and each test runs its own gateway over it; the tests that swap versions or kill the child start
their own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from openai import AsyncOpenAI, OpenAI

from fulmen.algorithm.tiny_model import TinyModelConfig, build_tiny_model
from fulmen.infra.settings import FulmenSettings
from fulmen.producers.llm_gateway import LlmGateway
from fulmen.producers.llm_gateway.backends import ReplicaRouter
from fulmen.producers.llm_gateway.backends.llamacpp import LlamaCppBackend
from fulmen.producers.llm_gateway.backends.llamacpp_build import find_server
from fulmen.producers.llm_gateway.settings import LlmSection
from fulmen.schemas import ModelVersion, TopicKey, semconv
from fulmen.schemas.errors import ConfigurationError
from fulmen.testing.llm_pipeline import (
    RecordingTransport,
    base_url,
    llm_gateway_running,
    llm_settings,
    published_spans,
)
from fulmen.testing.publishing import event_publisher
from fulmen.testing.served import Served

pytestmark = [pytest.mark.integration, pytest.mark.llamacpp]

SMOLLM2 = Path.home() / ".cache" / "fulmen" / "smollm2-135m-hf-v2"  # made by bench/smollm2.py
MESSAGES = [{"role": "user", "content": "Say something about the sea."}]


@pytest.fixture(scope="module", autouse=True)
def _llama_server() -> None:
    try:
        find_server()
    except ConfigurationError as exc:
        pytest.skip(f"no llama-server: {exc.message}")


class Kept:
    """A running router that a test's gateway uses but neither starts nor closes."""

    def __init__(self, router: ReplicaRouter) -> None:
        self.router = router

    def __getattr__(self, name: str) -> Any:
        return getattr(self.router, name)

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class SharedServer:
    """One llamacpp replica (and its router) for a module, on a thread's event loop."""

    def __init__(self, model: Path, home: Path, **llm: Any) -> None:
        self.model = model
        self.options = LlmSection(
            backend="llamacpp", model=str(model), model_version=0, llamacpp_slots=4, llamacpp_threads=2, **llm
        )
        self.transport = RecordingTransport()
        self.replica = LlamaCppBackend(self.options, 0, home, transport=self.transport)
        self.router = ReplicaRouter([self.replica], self.options)
        self.served = Served(self.router.start, self.router.close)

    def run(self, coroutine: Any, timeout_s: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.served.loop).result(timeout=timeout_s)

    @contextmanager
    def gateway(self, settings: FulmenSettings) -> Iterator[LlmGateway]:
        async def make() -> LlmGateway:  # its Kafka producer belongs to the loop it is made on
            options = self.options.model_dump(exclude={"model"})
            return LlmGateway(llm_settings(settings, self.model, **options), backend=Kept(self.router))  # type: ignore[arg-type]

        gateway = self.run(make())
        self.run(gateway.start())
        try:
            yield gateway
        finally:
            self.run(gateway.stop())


@pytest.fixture(scope="module")
def tiny_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServer]:
    shared = SharedServer(tiny_model, tmp_path_factory.mktemp("llamacpp-home"))
    with shared.served:
        yield shared


def trainer_logprobs(model_dir: Path, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from fulmen.algorithm.trainer.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        return token_logprobs(model, ids, torch.ones_like(ids))[0, len(prompt_ids) :]


def test_spans_record_the_ids_llama_server_sampled_with_the_trainers_logprobs(
    settings: FulmenSettings, tiny_server: SharedServer
) -> None:
    before = len(tiny_server.transport.exchanges)
    with tiny_server.gateway(settings) as gateway:
        client = OpenAI(base_url=base_url(gateway, "r-1"), api_key="x", max_retries=0)
        reply = client.chat.completions.create(model="fulmen", messages=MESSAGES, max_tokens=40, logprobs=True)
    [span] = asyncio.run(published_spans(settings, 1))
    attributes = span["attributes"]
    [(request, answer)] = tiny_server.transport.exchanges[before:]
    assert attributes[semconv.PROMPT_TOKEN_IDS] == request["prompt"]
    assert attributes[semconv.RESPONSE_TOKEN_IDS] == answer["tokens"]  # exactly what llama-server sampled
    assert attributes[semconv.MODEL_VERSION] == 0 and attributes[semconv.ROLLOUT_ID] == "r-1"
    logprobs = attributes[semconv.RESPONSE_LOGPROBS]
    assert logprobs == [t.logprob for t in reply.choices[0].logprobs.content]
    expected = trainer_logprobs(tiny_server.model, request["prompt"], answer["tokens"])
    assert (expected - torch.tensor(logprobs)).abs().mean() < 1e-3


def test_greedy_calls_repeat_and_lengths_stops_and_choices_are_honoured(
    settings: FulmenSettings, tiny_server: SharedServer
) -> None:
    with tiny_server.gateway(settings) as gateway:
        client = OpenAI(base_url=base_url(gateway), api_key="x", max_retries=0)
        ask = {"model": "fulmen", "messages": MESSAGES, "temperature": 0, "max_tokens": 24}
        first, second = (client.chat.completions.create(**ask) for _ in range(2))
        assert first.choices[0].message.content == second.choices[0].message.content  # greedy: the same
        text = first.choices[0].message.content
        short = client.chat.completions.create(**{**ask, "max_tokens": 3})
        stop = text[4:6] if len(text) >= 6 else text[-1:]
        stopped = client.chat.completions.create(**{**ask, "stop": [stop]})
        several = client.chat.completions.create(model="fulmen", messages=MESSAGES, max_tokens=5, n=3, seed=4)
        with pytest.raises(openai.BadRequestError) as too_long:
            client.chat.completions.create(model="fulmen", messages=[{"role": "user", "content": "x" * 3000}])
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].message.content == text[: text.find(stop)]
    assert len(several.choices) == 3 and all(len(c.message.content or "") >= 0 for c in several.choices)
    assert too_long.value.code == "context_length_exceeded"
    spans = asyncio.run(published_spans(settings, 7))  # the 3 choices: 3 spans; the refused call: none
    for span in spans:  # every span: one logprob per recorded id
        attributes = span["attributes"]
        assert len(attributes[semconv.RESPONSE_LOGPROBS]) == len(attributes[semconv.RESPONSE_TOKEN_IDS])
    stopped_ids = spans[3]["attributes"][semconv.RESPONSE_TOKEN_IDS]
    assert stopped_ids == spans[0]["attributes"][semconv.RESPONSE_TOKEN_IDS][: len(stopped_ids)]


def test_an_episodes_next_call_reuses_the_cached_prompt_and_a_group_shares_one_prefill(
    settings: FulmenSettings, tiny_server: SharedServer
) -> None:
    with tiny_server.gateway(settings) as gateway:
        client = OpenAI(base_url=base_url(gateway, "r-2"), api_key="x", max_retries=0)
        first = client.chat.completions.create(model="fulmen", messages=MESSAGES, max_tokens=16, temperature=0)
        before = len(tiny_server.transport.exchanges)
        turn = [
            *MESSAGES,
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And then?"},
        ]
        client.chat.completions.create(model="fulmen", messages=turn, max_tokens=4)
        [(_, answer)] = tiny_server.transport.exchanges[before:]
        assert answer["timings"]["cache_n"] >= first.usage.prompt_tokens  # the first prompt was not computed again

        async def group() -> list[Any]:
            async_client = AsyncOpenAI(base_url=base_url(gateway), api_key="x", max_retries=0)
            ask = {"model": "fulmen", "messages": [{"role": "user", "content": "group"}], "max_tokens": 8}
            return await asyncio.gather(*(async_client.chat.completions.create(**ask) for _ in range(4)))

        before = len(tiny_server.transport.exchanges)
        replies = asyncio.run(group())
    requests = [request for request, _ in tiny_server.transport.exchanges[before:]]
    assert len(replies) == 4 and sum(r["n_cmpl"] for r in requests) == 4
    assert len(requests) < 4  # calls that arrived together went as one request (prefilled once)


async def test_a_version_swap_under_load_fails_no_call(
    settings: FulmenSettings, tiny_model: Path, tmp_path: Path
) -> None:
    """Eight agents call without pause while version 1 is published and loads. Greedy answers' logprobs tell the
    versions apart: every call's are those of the version it reports; calls before and after the swap all succeed."""
    other = build_tiny_model(tmp_path / "v1", TinyModelConfig(seed=1))
    ask = {"model": "fulmen", "messages": MESSAGES, "temperature": 0, "max_tokens": 12, "logprobs": True}
    replies: list[Any] = []
    async with (
        event_publisher(settings) as publisher,
        llm_gateway_running(
            settings, tiny_model, backend="llamacpp", model_version=0, llamacpp_slots=4, llamacpp_threads=2
        ) as gateway,
    ):
        client = AsyncOpenAI(base_url=base_url(gateway), api_key="x", max_retries=0)
        v0 = logprobs(await client.chat.completions.create(**ask))
        swapped = asyncio.Event()

        async def agent() -> None:
            after = 0
            while after < 4:  # until it got four answers after the swap
                replies.append(await client.chat.completions.create(**ask))
                after += swapped.is_set()

        agents = [asyncio.create_task(agent()) for _ in range(8)]
        while len(replies) < 16:
            await asyncio.sleep(0.01)
        await publisher.publish(TopicKey.MODELS, ModelVersion(model_name="fulmen", version=1, uri=str(other)))
        async with asyncio.timeout(120):
            while gateway.backend.model_version != 1:
                await asyncio.sleep(0.01)
        swapped.set()
        await asyncio.gather(*agents)  # none failed
        v1 = logprobs(await client.chat.completions.create(**ask))
    assert (v0 - v1).abs().max() > 0.01
    spans = await published_spans(settings, len(replies) + 2)
    by_version = {0: v0, 1: v1}
    served = {r.id: logprobs(r) for r in replies}
    versions = [span["attributes"][semconv.MODEL_VERSION] for span in spans[1:-1]]
    for span, version in zip(spans[1:-1], versions, strict=True):
        reply = served[span["attributes"][semconv.GEN_AI_RESPONSE_ID]]
        torch.testing.assert_close(reply, by_version[version], rtol=0, atol=1e-3)
    assert len(replies) >= 50 and versions.count(0) >= 16 and versions.count(1) >= 16
    assert spans[-1]["attributes"][semconv.MODEL_VERSION] == 1


def logprobs(reply: Any) -> torch.Tensor:
    return torch.tensor([token.logprob for token in reply.choices[0].logprobs.content])


async def test_a_killed_child_is_replaced_and_the_replica_serves_again(
    settings: FulmenSettings, tiny_model: Path
) -> None:
    async with llm_gateway_running(
        settings,
        tiny_model,
        backend="llamacpp",
        model_version=0,
        llamacpp_slots=2,
        replica_retry_s=0.2,
        replica_retry_max_s=0.5,
    ) as gateway:
        client = AsyncOpenAI(base_url=base_url(gateway), api_key="x", max_retries=0)
        ask = {"model": "fulmen", "messages": MESSAGES, "max_tokens": 4}
        await client.chat.completions.create(**ask)
        replica = gateway.backend.slots[0].replica
        first = replica._serving.server
        first.process.kill()
        await first.process.wait()
        with pytest.raises(openai.APIStatusError) as failed:  # the call that finds it dead
            await client.chat.completions.create(**ask)
        assert failed.value.status_code == 503
        async with asyncio.timeout(60):
            while True:
                try:
                    reply = await client.chat.completions.create(**ask)
                    break
                except openai.APIStatusError:
                    await asyncio.sleep(0.1)
        assert replica._serving.server is not first and replica._serving.server.alive
        assert reply.system_fingerprint == "fulmen-v0"


@pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(), reason=f"no {SMOLLM2}: run python bench/smollm2.py")
def test_smollm2_logprobs_match_the_trainer_in_float32(settings: FulmenSettings, tmp_path: Path) -> None:
    """The Llama Q/K permutation: wrong rows would put the logprobs far off."""
    shared = SharedServer(SMOLLM2, tmp_path / "home", llamacpp_context=1024)
    with shared.served, shared.gateway(settings) as gateway:
        client = OpenAI(base_url=base_url(gateway), api_key="x", max_retries=0)
        client.chat.completions.create(model="fulmen", messages=MESSAGES, max_tokens=48, seed=1)
    [(request, answer)] = shared.transport.exchanges
    [span] = asyncio.run(published_spans(settings, 1))
    assert span["attributes"][semconv.RESPONSE_TOKEN_IDS] == answer["tokens"]
    expected = trainer_logprobs(SMOLLM2, request["prompt"], answer["tokens"])
    difference = (expected - torch.tensor(span["attributes"][semconv.RESPONSE_LOGPROBS])).abs()
    assert difference.mean() < 1e-3, (difference.mean(), difference.max())


def test_a_run_exported_as_a_q8_0_gguf_is_served_by_llama_server(tmp_path: Path) -> None:
    """``fulmen export RUN DIR --gguf q8_0``: a file llama-server loads and answers from."""
    import httpx

    from fulmen.export import export_model
    from fulmen.producers.llm_gateway.backends.llamacpp_process import LlamaServer

    run = tmp_path / "run"
    build_tiny_model(run / "checkpoints" / "v1")
    report = export_model(run, tmp_path / "out", gguf="q8_0")

    async def greedy() -> list[int]:
        # --no-repack: on these VMs (the CPU lists AMX) ggml's AMX q8_0 kernel dies of SIGILL at its first tilezero
        server = LlamaServer(find_server(), report.gguf[0], ["-c", "256", "--no-repack"], "export-check")
        await server.start(120.0)
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"prompt": [3, 17, 42, 7], "n_predict": 6, "temperature": 0, "return_tokens": True}
                answer = (await client.post(f"{server.url}/completion", json=body)).json()
        finally:
            await server.stop()
        return answer["tokens"]

    assert len(asyncio.run(greedy())) == 6
