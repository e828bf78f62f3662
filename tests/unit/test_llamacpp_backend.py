"""The llamacpp replica against a fake llama-server (an httpx transport and a process that does nothing): what it
asks for, how the answer becomes choices, coalescing, errors, versions and restarts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

from fulmen.algorithm.tiny_model import build_tiny_model
from fulmen.producers.llm_gateway.backends.base import VersionRefusedError
from fulmen.producers.llm_gateway.backends.llamacpp import LlamaCppBackend
from fulmen.producers.llm_gateway.backends.llamacpp_coalesce import Coalescer
from fulmen.producers.llm_gateway.backends.llamacpp_wire import completion_body, parse_samples, server_error
from fulmen.producers.llm_gateway.protocol import ApiError, SamplingParams, parse_chat
from fulmen.producers.llm_gateway.settings import LlmSection
from fulmen.schemas import ModelVersion
from fulmen.schemas.errors import ConfigurationError

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


class FakeServer:
    """A llama-server that starts at once on a made-up port; ``started`` lists every one made."""

    started: ClassVar[list[FakeServer]] = []
    ports: ClassVar[Iterator[int]] = iter(range(20000, 30000))

    def __init__(self, binary: Path, model: Path, arguments: list[str], label: str, environment: dict) -> None:
        self.model, self.arguments, self.label, self.environment = model, arguments, label, environment
        self.alive, self.port = False, next(self.ports)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def exit_reason(self) -> str:
        return f"llama-server {self.label} exited with -9"

    async def start(self, timeout_s: float) -> None:
        if not self.model.is_file():
            raise AssertionError(f"no GGUF at {self.model}")
        self.alive = True
        FakeServer.started.append(self)

    async def stop(self) -> None:
        self.alive = False


def answer(body: dict[str, Any], index: int = 0, tokens: list[int] | None = None, stop: str = "limit") -> dict:
    tokens = tokens if tokens is not None else [100 + index, 101 + index, 102 + index][: body["n_predict"]]
    probs = [
        {"id": t, "logprob": -0.5 - i, "top_logprobs": [{"id": t, "logprob": -0.5 - i}, {"id": 7, "logprob": -3.0}]}
        for i, t in enumerate(tokens)
    ]
    return {
        "index": index,
        "tokens": tokens,
        "completion_probabilities": probs,
        "stop_type": stop,
        "timings": {"cache_n": 0},
    }


def fake_llama(reply: Callable[[dict[str, Any]], Any] | None = None) -> tuple[httpx.MockTransport, list[dict]]:
    """A transport answering ``/health`` and ``/completion`` (``reply(body)`` -> JSON, or an httpx.Response)."""
    bodies: list[dict] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            alive = any(s.port == request.url.port and s.alive for s in FakeServer.started)
            return httpx.Response(200 if alive else 503, json={"status": "ok"})
        body = json.loads(request.content)
        body["port"] = request.url.port
        bodies.append(body)
        if reply is not None:
            out = reply(body)
            return out if isinstance(out, httpx.Response) else httpx.Response(200, json=out)
        items = [answer(body, i) for i in range(body["n_cmpl"])]
        return httpx.Response(200, json=items[0] if len(items) == 1 else items)

    return httpx.MockTransport(handle), bodies


async def started(tiny: Path, tmp_path: Path, transport: httpx.MockTransport, **llm: Any) -> LlamaCppBackend:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    options = LlmSection(
        backend="llamacpp", model=str(tiny), llamacpp_server=str(binary), llamacpp_slots=4, model_version=0, **llm
    )
    backend = LlamaCppBackend(options, 0, tmp_path / "home", transport=transport, server=FakeServer)
    await backend.start()
    return backend


def chat(**body: Any):
    return parse_chat({"model": "fulmen", "messages": MESSAGES, **body}, 16)


async def test_a_call_sends_the_prompt_ids_and_reports_what_llama_server_sampled(tiny: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    transport, bodies = fake_llama()
    backend = await started(tiny, tmp_path, transport)
    try:
        result = await backend.chat(chat(max_tokens=3, temperature=0.7, top_p=0.9, seed=5))
    finally:
        await backend.close()
    [body] = bodies
    expected = AutoTokenizer.from_pretrained(tiny).apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert body["prompt"] == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert result.prompt_token_ids == body["prompt"] and result.model_version == 0
    assert body["samplers"] == ["temperature", "top_p"] and body["top_k"] == 0 and body["min_p"] == 0
    assert body["repeat_penalty"] == 1.0 and body["dry_multiplier"] == 0 and body["xtc_probability"] == 0
    assert (body["temperature"], body["top_p"], body["seed"], body["n_predict"]) == (0.7, 0.9, 5, 3)
    assert body["n_probs"] == 1 and body["post_sampling_probs"] is False and body["return_tokens"] is True
    [choice] = result.choices
    assert choice.token_ids == [100, 101, 102] and choice.logprobs == [-0.5, -1.5, -2.5]
    assert choice.finish_reason == "length" and result.completion_tokens == 3
    server = FakeServer.started[-1]
    assert server.arguments[server.arguments.index("-ctk") + 1] == "f32" and "-fa" in server.arguments
    assert server.arguments[server.arguments.index("-np") + 1] == "4"
    assert server.arguments[server.arguments.index("-c") + 1] == str(4 * 2048)  # the tiny model's 2048 a slot
    assert server.environment == {"OMP_WAIT_POLICY": "PASSIVE"}  # no spinning on cores others use


async def test_top_logprobs_and_finish_reasons_map_to_openai(tiny: Path, tmp_path: Path) -> None:
    stops = iter(["eos", "word", "limit"])
    transport, bodies = fake_llama(lambda body: answer(body, stop=next(stops)))
    backend = await started(tiny, tmp_path, transport, llamacpp_coalesce_ms=0)
    try:
        first = await backend.chat(chat(max_tokens=3, logprobs=True, top_logprobs=2))
        second = await backend.chat(chat(max_tokens=3))
        third = await backend.chat(chat(max_tokens=3))
    finally:
        await backend.close()
    assert bodies[0]["n_probs"] == 2
    detail = first.choices[0].token_logprobs
    assert detail is not None and [t.logprob for t in detail] == [-0.5, -1.5, -2.5]
    assert [value for _, value in detail[0].top] == [-0.5, -3.0]
    assert [r.choices[0].finish_reason for r in (first, second, third)] == ["stop", "stop", "length"]


async def test_probabilities_that_do_not_name_the_sampled_tokens_fail_the_call(tiny: Path, tmp_path: Path) -> None:
    def unpatched(body: dict) -> dict:
        out = answer(body)
        out["completion_probabilities"] = out["completion_probabilities"][:2]  # a stock llama-server drops some
        return out

    def swapped(body: dict) -> dict:
        out = answer(body)
        out["completion_probabilities"][1]["id"] = 5
        return out

    for reply, message in ((unpatched, "3 tokens came with 2 probabilities"), (swapped, "at position 1")):
        backend = await started(tiny, tmp_path, fake_llama(reply)[0])
        try:
            with pytest.raises(ApiError, match=message) as caught:
                await backend.chat(chat(max_tokens=3))
        finally:
            await backend.close()
        assert caught.value.status == 502 and caught.value.kind == "upstream_error"


async def test_errors_of_llama_server_and_of_the_request(tiny: Path, tmp_path: Path) -> None:
    refusal = {"error": {"code": 400, "message": "request (9000 tokens) exceeds the available context size"}}
    answers = iter([httpx.Response(400, json=refusal), httpx.Response(500, text="boom")])
    backend = await started(tiny, tmp_path, fake_llama(lambda body: next(answers))[0])
    try:
        with pytest.raises(ApiError, match="exceeds the available context") as refused:
            await backend.chat(chat(max_tokens=3))
        with pytest.raises(ApiError, match="answered 500: boom") as failed:
            await backend.chat(chat(max_tokens=3))
        with pytest.raises(ApiError, match="maximum context length is 2048") as too_long:
            await backend.chat(chat(max_tokens=5000))  # refused before llama-server is asked
    finally:
        await backend.close()
    assert (refused.value.status, refused.value.code) == (400, "context_length_exceeded")
    assert (failed.value.status, failed.value.kind) == (502, "upstream_error")
    assert too_long.value.status == 400

    def unreachable(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    backend = await started(tiny, tmp_path, httpx.MockTransport(unreachable))
    try:
        with pytest.raises(ApiError, match="cannot be reached") as down:
            await backend.chat(chat(max_tokens=3))
    finally:
        await backend.close()
    assert (down.value.status, down.value.kind) == (503, "upstream_unavailable")


async def test_concurrent_calls_with_one_prompt_share_one_request(tiny: Path, tmp_path: Path) -> None:
    transport, bodies = fake_llama()
    backend = await started(tiny, tmp_path, transport, llamacpp_coalesce_ms=200)
    try:
        results = await asyncio.gather(*(backend.chat(chat(max_tokens=3)) for _ in range(3)))
        seeded = await asyncio.gather(*(backend.chat(chat(max_tokens=3, seed=s)) for s in (1, 2)))
        many = await backend.chat(chat(max_tokens=3, n=6, seed=10))  # more than the 4 slots: two requests
    finally:
        await backend.close()
    assert [b["n_cmpl"] for b in bodies[:1]] == [3]
    assert sorted(r.choices[0].token_ids[0] for r in results) == [100, 101, 102]  # each its own completion
    assert sorted(b["seed"] for b in bodies[1:3]) == [1, 2] and all(b["n_cmpl"] == 1 for b in bodies[1:3])
    assert [(b["n_cmpl"], b["seed"]) for b in bodies[3:]] == [(4, 10), (2, 14)]
    assert len(many.choices) == 6 and [c.index for c in many.choices] == list(range(6))
    assert {r.choices[0].token_ids[0] for r in seeded} == {100}


async def test_coalescer_fills_a_group_up_to_the_slots_and_fails_every_member_together() -> None:
    sent: list[dict] = []

    async def send(body: dict, n: int, top: int) -> list:
        sent.append(body)
        if body["prompt"] == [9]:
            raise ApiError(503, "down", kind="upstream_unavailable")
        return parse_samples([answer(body, i) for i in range(n)] if n > 1 else answer(body), n, top)

    coalescer = Coalescer(send, wait_s=10.0, limit=4)  # a group goes when full, not after 10 s
    sampling = SamplingParams(max_tokens=2, n=2)
    outs = await asyncio.wait_for(asyncio.gather(*(coalescer.join([1, 2], sampling, 2) for _ in range(2))), 5)
    assert [b["n_cmpl"] for b in sent] == [4] and [len(o) for o in outs] == [2, 2]
    assert [s.token_ids[0] for o in outs for s in o] == [100, 101, 102, 103]
    failing = [coalescer.join([9], sampling, 2) for _ in range(2)]
    results = await asyncio.wait_for(asyncio.gather(*failing, return_exceptions=True), 5)
    assert all(isinstance(r, ApiError) and r.status == 503 for r in results)


async def test_a_version_loads_beside_the_one_serving_which_finishes_its_calls(tiny: Path, tmp_path: Path) -> None:
    release = asyncio.Event()
    transport, bodies = fake_llama()
    backend = await started(tiny, tmp_path, transport)
    old = FakeServer.started[-1]
    original_post = backend._post

    async def slow_post(serving: Any, body: dict, n: int, top: int) -> Any:
        if serving.server is old:
            await release.wait()
        return await original_post(serving, body, n, top)

    backend._post = slow_post  # the call on the old version is in flight during the swap
    try:
        in_flight = asyncio.create_task(backend.chat(chat(max_tokens=3, seed=1)))
        await asyncio.sleep(0.2)
        copy = tmp_path / "v1"
        build_tiny_model(copy)
        await backend.load_version(ModelVersion(model_name="fulmen", version=1, uri=str(copy)))
        new = FakeServer.started[-1]
        assert new is not old and backend.model_version == 1 and old.alive  # still finishing its call
        fresh = await backend.chat(chat(max_tokens=3, seed=1))
        release.set()
        assert (await in_flight).model_version == 0 and fresh.model_version == 1
        await asyncio.sleep(0.1)
        assert not old.alive and not old.model.exists()  # stopped, and its GGUF deleted
        with pytest.raises(VersionRefusedError, match="could not serve"):
            await backend.load_version(ModelVersion(model_name="fulmen", version=2, uri=str(tmp_path / "nope")))
        assert backend.model_version == 1 and new.alive
        with pytest.raises(ConfigurationError, match="does not serve per-agent adapters yet"):
            backend.swaps_in_place(
                ModelVersion(model_name="fulmen", version=3, uri=str(copy), format="hf_lora_adapter", adapter="solver")
            )
    finally:
        release.set()
        await backend.close()
    assert {b["port"] for b in bodies} == {old.port, new.port}


async def test_probe_starts_another_server_when_the_child_died(tiny: Path, tmp_path: Path) -> None:
    transport, _ = fake_llama()
    backend = await started(tiny, tmp_path, transport)
    try:
        first = FakeServer.started[-1]
        await backend.probe()
        assert FakeServer.started[-1] is first
        first.alive = False
        with pytest.raises(ApiError, match="exited") as caught:
            await backend.chat(chat(max_tokens=3))
        assert caught.value.kind == "upstream_unavailable"
        await backend.probe()
        assert FakeServer.started[-1] is not first and FakeServer.started[-1].model == first.model
        assert (await backend.chat(chat(max_tokens=3))).model_version == 0
    finally:
        await backend.close()


async def test_without_a_built_server_start_up_says_how_to_build_it(tiny: Path, tmp_path: Path) -> None:
    options = LlmSection(backend="llamacpp", model=str(tiny), llamacpp_server=str(tmp_path / "missing"))
    with pytest.raises(ConfigurationError, match="is not an executable file"):
        await LlamaCppBackend(options, 0, tmp_path).start()
    with pytest.raises(ConfigurationError, match="needs a model directory"):
        LlamaCppBackend(LlmSection(backend="llamacpp"), 0, tmp_path)


def test_the_request_asks_for_the_raw_distribution_and_seeds_fit_llama_cpp() -> None:
    body = completion_body([1, 2], SamplingParams(temperature=0, seed=2**40, stop=("x",), top_logprobs=3), 5, 2)
    assert body["seed"] == 2**40 % (2**32 - 1) and body["stop"] == ["x"] and body["n_probs"] == 3
    assert completion_body([1], SamplingParams(), 5, 1)["seed"] == -1 and "ignore_eos" not in body
    answers = [answer({"n_predict": 3}, 1), answer({"n_predict": 3}, 0)]
    assert [s.token_ids[0] for s in parse_samples(answers, 2, 0)] == [100, 101]  # by index
    with pytest.raises(ApiError, match="2 completion"):
        parse_samples(answers[0], 2, 0)
    assert server_error(503, {"error": {"message": "Loading model"}}).kind == "upstream_unavailable"
