"""The LLM gateway under hostile input: a bad call fails alone, big prompts stay off the event loop, auth and
body limits hold, and ``fulmen llm-gateway --model tiny`` starts (tiny model, real broker)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI

from fulmen.infra.processes import free_port
from fulmen.infra.settings import FulmenSettings
from fulmen.producers.llm_gateway.backends import transformers_backend
from fulmen.testing.llm_pipeline import base_url, llm_gateway_running
from tests.raw_http import send_raw

pytestmark = [pytest.mark.integration, pytest.mark.security]

GOOD = {"model": "fulmen", "prompt": "hello", "max_tokens": 4}


async def _raw(port: int, payload: bytes, wait_s: float = 10.0) -> bytes:
    return await send_raw(port, payload, wait_s)


async def test_a_bad_call_fails_alone(settings: FulmenSettings, tiny_model: Path) -> None:
    # A long batch window: the 13 calls below would all share one batch.
    async with (
        llm_gateway_running(settings, tiny_model, batch_wait_ms=300) as gateway,
        httpx.AsyncClient(timeout=120) as client,
    ):
        url = f"{base_url(gateway)}/completions"
        bad = client.post(url, json={**GOOD, "logprobs": True})
        answers = await asyncio.gather(bad, *(client.post(url, json=GOOD) for _ in range(12)))
    assert answers[0].status_code == 400 and answers[0].json()["error"]["param"] == "logprobs"
    assert [a.status_code for a in answers[1:]] == [200] * 12


async def test_a_batch_that_fails_is_retried_call_by_call(
    settings: FulmenSettings, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = transformers_backend.generate

    def generate(model, rows, *args):  # a call that validation let through but generation cannot serve
        if any(row.max_new_tokens == 13 for row in rows):
            raise RuntimeError("boom")
        return real(model, rows, *args)

    monkeypatch.setattr(transformers_backend, "generate", generate)
    async with (
        llm_gateway_running(settings, tiny_model, batch_wait_ms=300) as gateway,
        httpx.AsyncClient(timeout=120) as client,
    ):
        url = f"{base_url(gateway)}/completions"
        answers = await asyncio.gather(
            client.post(url, json={**GOOD, "max_tokens": 13}), *(client.post(url, json=GOOD) for _ in range(8))
        )
    assert answers[0].status_code == 500
    assert [a.status_code for a in answers[1:]] == [200] * 8


async def test_healthz_answers_while_a_10mb_prompt_is_handled(settings: FulmenSettings, tiny_model: Path) -> None:
    prompt = "word " * (2 * 1024 * 1024)  # 10 MB
    async with llm_gateway_running(settings, tiny_model) as gateway, httpx.AsyncClient(timeout=120) as client:
        root = f"http://127.0.0.1:{gateway.port}"
        for path in ("/v1/completions", "/v1/chat/completions"):
            body = (
                {**GOOD, "prompt": prompt}
                if "chat" not in path
                else {"model": "fulmen", "messages": [{"role": "user", "content": prompt}]}
            )
            call = asyncio.create_task(client.post(f"{root}{path}", json=body))
            worst = 0.0
            while not call.done():
                started = time.perf_counter()
                assert (await client.get(f"{root}/healthz")).status_code == 200
                worst = max(worst, time.perf_counter() - started)
                await asyncio.sleep(0.02)
            answer = await call
            print(f"{path} 10 MB prompt: {answer.status_code}, worst /healthz latency {worst * 1000:.0f} ms")
            assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded"
            assert worst < 5.0  # a liveness bound with room for a loaded CI machine (the issue measured 11.6 s)


async def test_bearer_token_body_limit_and_read_timeout(settings: FulmenSettings, tiny_model: Path) -> None:
    options = {"bearer_token": "s3cret", "max_body_bytes": 1024 * 1024, "read_timeout_s": 1.0}
    async with llm_gateway_running(settings, tiny_model, **options) as gateway, httpx.AsyncClient(timeout=30) as client:
        root = f"http://127.0.0.1:{gateway.port}"
        assert (await client.get(f"{root}/healthz")).status_code == 200
        for path in ("/v1/models", "/rollout/r-1/attempt/1/v1/models"):
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
                answer = await client.get(f"{root}{path}", headers=headers)
                assert answer.status_code == 401 and answer.headers["WWW-Authenticate"].startswith("Bearer")
                assert answer.json()["error"]["type"] == "authentication_error"
        agent = AsyncOpenAI(base_url=base_url(gateway, "r-1"), api_key="s3cret", max_retries=0)
        reply = await agent.completions.create(model="fulmen", prompt="hi", max_tokens=2)
        assert reply.choices
        auth = b"Authorization: Bearer s3cret\r\n"
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        answer = await _raw(gateway.port, head + b"Authorization: Bearer s3\xffcret\r\nContent-Length: 2\r\n\r\n{}")
        assert answer.startswith(b"HTTP/1.1 401")
        answer = await _raw(gateway.port, head + auth + b"Content-Length: 104857600\r\n\r\n", wait_s=5)
        assert answer.startswith(b"HTTP/1.1 413")
        answer = await _raw(gateway.port, head + auth + b"Content-Length: 100\r\n\r\n{", wait_s=10)
        assert answer.startswith(b"HTTP/1.1 408") and b"invalid_request_error" in answer


def test_cli_llm_gateway_serves_the_tiny_model(settings: FulmenSettings, tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {
        "FULMEN_KAFKA_BOOTSTRAP": settings.bootstrap,
        "FULMEN_HOME": str(tmp_path),
        "FULMEN_KAFKA_TOPIC_PREFIX": settings.kafka.topic_prefix,
        "FULMEN_LLM_FOLLOW_MODELS": "false",
    }
    command = [sys.executable, "-m", "fulmen.cli.main", "llm-gateway", "--model", "tiny", "--port", str(port)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=GOOD, timeout=60)
        assert reply.status_code == 200, reply.text
        assert (tmp_path / "models" / "tiny" / "config.json").is_file()
    finally:
        process.terminate()
        process.wait(timeout=30)
