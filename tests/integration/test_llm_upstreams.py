"""The vllm and openai backends against stand-in upstreams, and a marked test against a real vLLM on a GPU.

The stand-in answers as vLLM's OpenAI server does when asked for ``return_token_ids`` (vLLM >= 0.10.2):
chat responses carry ``prompt_token_ids`` at the top level and ``token_ids`` per choice; completions carry
both per choice; logprobs are in ``choices[].logprobs.content[].logprob`` (chat) and
``choices[].logprobs.token_logprobs`` (completions).
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai
import pytest
from aiohttp import web
from openai import AsyncOpenAI

from fulmen.infra.settings import FulmenSettings
from fulmen.schemas import semconv
from fulmen.testing.llm_pipeline import base_url, llm_gateway_running, published_spans

pytestmark = pytest.mark.integration

PROMPT_IDS = [151644, 872, 198, 13048]
TOKEN_IDS = [9707, 0, 151645]
LOGPROBS = [-0.25, -1.5, -0.01]


class StandIn:
    """An upstream that records what it was asked and answers like vLLM (or like a plain OpenAI server)."""

    def __init__(self, vllm: bool = True, status: int = 200) -> None:
        self.vllm = vllm
        self.status = status
        self.requests: list[dict[str, Any]] = []

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        if self.status != 200:
            return web.json_response({"error": {"message": "boom"}}, status=self.status)
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": "Hi!"},
            "finish_reason": "stop",
        }
        data: dict[str, Any] = {
            "id": "chatcmpl-up",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [choice],
            "usage": {"prompt_tokens": 4, "completion_tokens": 3},
        }
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {"token": t, "logprob": lp, "top_logprobs": []}
                    for t, lp in zip(["Hi", "!", ""], LOGPROBS, strict=True)
                ]
            }
        if self.vllm and body.get("return_token_ids"):
            data["prompt_token_ids"] = PROMPT_IDS
            choice["token_ids"] = TOKEN_IDS
        return web.json_response(data)

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        choice: dict[str, Any] = {
            "index": 0,
            "text": "Hi!",
            "finish_reason": "stop",
            "logprobs": {
                "tokens": ["Hi", "!", ""],
                "token_logprobs": LOGPROBS,
                "top_logprobs": None,
                "text_offset": [0, 2, 3],
            },
        }
        if self.vllm and body.get("return_token_ids"):
            choice["prompt_token_ids"] = PROMPT_IDS
            choice["token_ids"] = TOKEN_IDS
        return web.json_response(
            {
                "id": "cmpl-up",
                "object": "text_completion",
                "model": body["model"],
                "choices": [choice],
                "usage": {"prompt_tokens": 4, "completion_tokens": 3},
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "Qwen/Qwen2.5-0.5B", "max_model_len": 4096}]})


@asynccontextmanager
async def stand_in(upstream: StandIn) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", upstream.chat)
    app.router.add_post("/v1/completions", upstream.completions)
    app.router.add_get("/v1/models", upstream.models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()


def upstream_options(url: str, backend: str) -> dict[str, Any]:
    return {
        "backend": backend,
        "model": "Qwen/Qwen2.5-0.5B",
        "upstream_url": url,
        "follow_models": False,
        "model_version": 4,
    }


async def test_vllm_backend_records_the_upstreams_token_ids(settings: FulmenSettings) -> None:
    upstream = StandIn()
    async with stand_in(upstream) as url, llm_gateway_running(settings, **upstream_options(url, "vllm")) as gateway:
        client = AsyncOpenAI(base_url=base_url(gateway, "r-v"), api_key="x", max_retries=0)
        chat = await client.chat.completions.create(model="fulmen", messages=[{"role": "user", "content": "hi"}])
        text = await client.completions.create(model="fulmen", prompt="hi", max_tokens=3)
        assert gateway.backend.context_length == 4096
    assert chat.choices[0].message.content == "Hi!" and chat.choices[0].logprobs is None  # not asked for
    assert text.choices[0].text == "Hi!"
    asked_chat, asked_text = upstream.requests
    assert asked_chat["model"] == "Qwen/Qwen2.5-0.5B" and asked_chat["return_token_ids"] and asked_chat["logprobs"]
    assert asked_text["return_token_ids"] and asked_text["logprobs"] == 0
    for span in await published_spans(settings, 2):
        attributes = span["attributes"]
        assert attributes[semconv.PROMPT_TOKEN_IDS] == PROMPT_IDS
        assert attributes[semconv.RESPONSE_TOKEN_IDS] == TOKEN_IDS
        assert attributes[semconv.RESPONSE_LOGPROBS] == LOGPROBS
        assert attributes[semconv.MODEL_VERSION] == 4 and attributes[semconv.ROLLOUT_ID] == "r-v"
        assert attributes[semconv.GEN_AI_PROVIDER_NAME] == "fulmen.vllm"


async def test_openai_backend_records_what_it_can_and_says_why_token_ids_are_absent(settings: FulmenSettings) -> None:
    upstream = StandIn(vllm=False)
    async with stand_in(upstream) as url, llm_gateway_running(settings, **upstream_options(url, "openai")) as gateway:
        client = AsyncOpenAI(base_url=base_url(gateway), api_key="x", max_retries=0)
        chat = await client.chat.completions.create(model="fulmen", messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == "Hi!"
    assert "return_token_ids" not in upstream.requests[0]
    [span] = await published_spans(settings, 1)
    attributes = span["attributes"]
    assert (
        semconv.PROMPT_TOKEN_IDS not in attributes
        and "does not return token ids" in attributes[semconv.TOKEN_IDS_ABSENT_REASON]
    )
    assert json.loads(attributes[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == "Hi!"


async def test_upstream_failures_are_502_and_503(settings: FulmenSettings) -> None:
    async with (
        stand_in(StandIn(status=500)) as url,
        llm_gateway_running(settings, **upstream_options(url, "vllm")) as gateway,
    ):
        client = AsyncOpenAI(base_url=base_url(gateway), api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as failed:
            await client.chat.completions.create(model="fulmen", messages=[{"role": "user", "content": "hi"}])
        assert failed.value.status_code == 502
    dead = upstream_options("http://127.0.0.1:9/v1", "vllm")
    async with llm_gateway_running(settings, **dead) as gateway:
        client = AsyncOpenAI(base_url=base_url(gateway), api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as unreachable:
            await client.chat.completions.create(model="fulmen", messages=[{"role": "user", "content": "hi"}])
        assert unreachable.value.status_code == 503 and unreachable.value.response.headers["Retry-After"] == "1"


@pytest.mark.gpu
@pytest.mark.skipif(
    not os.environ.get("FULMEN_TEST_VLLM_URL"),
    reason="needs a real vLLM OpenAI server on a GPU (vllm wheels are CUDA-only): set FULMEN_TEST_VLLM_URL=http://host:port/v1 "
    "and FULMEN_TEST_VLLM_MODEL",
)
async def test_real_vllm_returns_token_ids_that_the_span_records(settings: FulmenSettings) -> None:
    url, model = os.environ["FULMEN_TEST_VLLM_URL"], os.environ.get("FULMEN_TEST_VLLM_MODEL", "")
    options = {"backend": "vllm", "model": model, "upstream_url": url, "follow_models": False}
    async with llm_gateway_running(settings, **options) as gateway:
        client = AsyncOpenAI(base_url=base_url(gateway), api_key="x", max_retries=0)
        chat = await client.chat.completions.create(
            model="fulmen", messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0
        )
    [span] = await published_spans(settings, 1)
    assert len(span["attributes"][semconv.RESPONSE_TOKEN_IDS]) == chat.usage.completion_tokens
    assert len(span["attributes"][semconv.RESPONSE_LOGPROBS]) == chat.usage.completion_tokens
