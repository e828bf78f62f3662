"""The LLM gateway with the transformers backend on a tiny model, a real broker, and the official openai client."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest
from aiokafka.errors import KafkaConnectionError
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from fulmen.infra.settings import FulmenSettings
from fulmen.producers.llm_gateway import LlmGateway
from fulmen.schemas import ModelVersion, TopicKey, semconv
from fulmen.testing.llm_pipeline import base_url, llm_gateway_running, llm_settings, published_spans
from fulmen.testing.publishing import event_publisher
from tests.models import WEATHER_ANSWER, WEATHER_TOOL

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say something, é ✓"}]


async def test_chat_call_records_one_span_with_token_ids_that_decode_exactly(
    settings: FulmenSettings, tiny_model: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    async with llm_gateway_running(settings, tiny_model, model_version=0) as gateway:
        client = AsyncOpenAI(base_url=base_url(gateway, "r-1", attempt=2), api_key="x", max_retries=0)
        response = await client.chat.completions.create(model="fulmen", messages=MESSAGES, max_tokens=20, seed=3)
    [span] = await published_spans(settings, 1)
    attributes = span["attributes"]
    assert span["name"] == "chat fulmen" and span["kind"] == 2  # SERVER
    assert span["key"] == span["trace_id"]
    assert attributes[semconv.ROLLOUT_ID] == "r-1" and attributes[semconv.ROLLOUT_ATTEMPT] == 2
    assert attributes[semconv.MODEL_VERSION] == 0
    prompt_ids, response_ids = attributes[semconv.PROMPT_TOKEN_IDS], attributes[semconv.RESPONSE_TOKEN_IDS]
    assert tokenizer.decode(prompt_ids) == tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.decode(response_ids, skip_special_tokens=True) == response.choices[0].message.content
    assert len(attributes[semconv.RESPONSE_LOGPROBS]) == len(response_ids)
    assert all(lp <= 0 for lp in attributes[semconv.RESPONSE_LOGPROBS])
    assert response.usage.prompt_tokens == len(prompt_ids) == attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS]
    assert response.usage.completion_tokens == len(response_ids)
    assert attributes[semconv.GEN_AI_RESPONSE_ID] == response.id
    assert json.loads(attributes[semconv.GEN_AI_INPUT_MESSAGES]) == MESSAGES
    assert json.loads(attributes[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == response.choices[0].message.content


async def test_streaming_returns_the_same_tokens_as_non_streaming(settings: FulmenSettings, tiny_model: Path) -> None:
    async with llm_gateway_running(settings, tiny_model) as gateway:
        client = AsyncOpenAI(base_url=base_url(gateway), api_key="x", max_retries=0)
        request = {"model": "fulmen", "messages": MESSAGES, "max_tokens": 24, "seed": 11, "temperature": 1.0}
        whole = await client.chat.completions.create(**request, logprobs=True)
        stream = await client.chat.completions.create(
            **request, logprobs=True, stream=True, stream_options={"include_usage": True}
        )
        pieces, streamed_logprobs, finish, usage = [], [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                if choice.logprobs and choice.logprobs.content:
                    streamed_logprobs.extend(t.logprob for t in choice.logprobs.content)
                finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    first, second = await published_spans(settings, 2)
    assert first["attributes"][semconv.RESPONSE_TOKEN_IDS] == second["attributes"][semconv.RESPONSE_TOKEN_IDS]
    assert streamed_logprobs == [t.logprob for t in whole.choices[0].logprobs.content]


async def test_tool_calls_round_trip(settings: FulmenSettings, tool_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    async with llm_gateway_running(settings, tool_model) as gateway:
        client = AsyncOpenAI(base_url=base_url(gateway, "r-tools"), api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        first = await client.chat.completions.create(
            model="fulmen", messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=120
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        second = await client.chat.completions.create(
            model="fulmen", messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=60
        )
    assert second.choices[0].message.content == WEATHER_ANSWER and second.choices[0].finish_reason == "stop"
    spans = await published_spans(settings, 2)
    calls = [span["attributes"] for span in spans]
    assert "<tool_call>" in tokenizer.decode(calls[0][semconv.RESPONSE_TOKEN_IDS])
    assert json.loads(calls[0][semconv.GEN_AI_OUTPUT_MESSAGES])[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0][semconv.GEN_AI_TOOL_DEFINITIONS]) == [WEATHER_TOOL]
    # The second prompt holds the first call's tool call as the template renders it, then the tool's answer.
    assert "<|im_start|>tool\nsunny<|im_end|>" in tokenizer.decode(calls[1][semconv.PROMPT_TOKEN_IDS])


async def test_traceparent_puts_the_span_under_the_callers_span(settings: FulmenSettings, tiny_model: Path) -> None:
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    async with llm_gateway_running(settings, tiny_model) as gateway, httpx.AsyncClient() as http:
        response = await http.post(
            f"{base_url(gateway)}/chat/completions",
            json={"model": "fulmen", "messages": MESSAGES, "max_tokens": 4},
            headers={"traceparent": f"00-{trace_id}-{parent}-01"},
        )
        assert response.status_code == 200
    [span] = await published_spans(settings, 1)
    assert (span["trace_id"], span["parent_span_id"]) == (trace_id, parent)


async def test_completions_with_token_ids_logprobs_and_several_choices(
    settings: FulmenSettings, tiny_model: Path
) -> None:
    async with llm_gateway_running(settings, tiny_model) as gateway:
        client = AsyncOpenAI(base_url=base_url(gateway), api_key="x", max_retries=0)
        result = await client.completions.create(
            model="fulmen", prompt=[40, 41, 42], max_tokens=6, n=2, logprobs=2, seed=1
        )
    assert len(result.choices) == 2
    for choice in result.choices:
        assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.tokens) <= 6
        assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)  # a dict: equal strings merge
    spans = await published_spans(settings, 2)
    assert [s["attributes"][semconv.PROMPT_TOKEN_IDS] for s in spans] == [[40, 41, 42]] * 2
    assert {s["attributes"][semconv.GEN_AI_OPERATION_NAME] for s in spans} == {"text_completion"}


async def test_bad_requests_get_openai_errors_and_record_nothing(settings: FulmenSettings, tiny_model: Path) -> None:
    async with llm_gateway_running(settings, tiny_model, max_model_len=96) as gateway:
        client = AsyncOpenAI(base_url=base_url(gateway), api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as too_long:
            await client.chat.completions.create(model="fulmen", messages=[{"role": "user", "content": "x" * 100}])
        assert too_long.value.code == "context_length_exceeded"
        assert "maximum context length is 96 tokens" in too_long.value.message
        with pytest.raises(openai.BadRequestError, match="60 in the completion"):
            await client.chat.completions.create(model="fulmen", messages=MESSAGES, max_tokens=60)
        with pytest.raises(openai.BadRequestError) as no_messages:
            await client.chat.completions.create(model="fulmen", messages=[])
        assert no_messages.value.param == "messages"
        with pytest.raises(openai.BadRequestError, match="temperature"):
            await client.chat.completions.create(model="fulmen", messages=MESSAGES, temperature=3)
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
        async with httpx.AsyncClient() as http:
            bad_json = await http.post(f"{base_url(gateway)}/chat/completions", content=b"{not json")
            bad_attempt = await http.post(f"{base_url(gateway, 'r-1', 0)}/chat/completions", json={})
        assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
        assert bad_attempt.status_code == 400 and bad_attempt.json()["error"]["param"] == "attempt"
        ok = await client.chat.completions.create(
            model="fulmen", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert ok.choices
    assert len(await published_spans(settings, 1)) == 1  # only the good call was recorded


class _DeadProducer:
    """A producer whose broker never acknowledges."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def send_and_wait(self, *args: object, **kwargs: object) -> None:
        raise KafkaConnectionError("broker down")


async def test_a_call_whose_span_cannot_be_recorded_is_a_503(settings: FulmenSettings, tiny_model: Path) -> None:
    gateway = LlmGateway(llm_settings(settings, tiny_model, follow_models=False), kafka_producer=_DeadProducer())  # type: ignore[arg-type]
    await gateway.start()
    try:
        async with httpx.AsyncClient() as http:
            response = await http.post(
                f"{base_url(gateway)}/chat/completions", json={"model": "fulmen", "messages": MESSAGES, "max_tokens": 2}
            )
    finally:
        await gateway.stop()
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert "could not be recorded" in response.json()["error"]["message"]


async def test_follows_new_model_versions_without_failing_calls(
    settings: FulmenSettings, tiny_model: Path, tool_model: Path
) -> None:
    async with (
        event_publisher(settings) as publisher,
        llm_gateway_running(settings, tiny_model, model_version=0) as gateway,
    ):
        client = AsyncOpenAI(base_url=base_url(gateway), api_key="x", max_retries=0)
        ask = {
            "model": "fulmen",
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER_TOOL],
            "temperature": 0,
            "max_tokens": 100,
        }
        before = [asyncio.create_task(client.chat.completions.create(**ask)) for _ in range(4)]
        await publisher.publish(TopicKey.MODELS, ModelVersion(model_name="fulmen", version=1, uri=str(tool_model)))
        await publisher.publish(TopicKey.MODELS, ModelVersion(model_name="other", version=9, uri="/nowhere"))
        async with asyncio.timeout(60):
            while gateway.backend.model_version != 1:
                await asyncio.sleep(0.05)
        answers = await asyncio.gather(*before)  # in flight during the swap: all answered
        assert all(answer.choices for answer in answers)
        after = await client.chat.completions.create(**ask)
    assert after.choices[0].message.tool_calls[0].function.name == "get_weather"  # the new weights answer
    assert after.system_fingerprint == "fulmen-v1"
    spans = await published_spans(settings, 5)
    assert spans[-1]["attributes"][semconv.MODEL_VERSION] == 1
    assert {s["attributes"][semconv.MODEL_VERSION] for s in spans[:4]} <= {0, 1}


@pytest.mark.multiagent
async def test_a_call_that_names_its_agent_gets_that_agents_adapter(
    settings: FulmenSettings, tiny_model: Path, tmp_path: Path
) -> None:
    """``.../agent/{name}/v1``: the gateway follows an agent's adapter on the models topic and serves it to that
    agent's calls; another agent's calls get the model; each span says which agent called and what served it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "write"
    get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model),
        LoraConfig(r=2, target_modules=["q_proj"]),
        adapter_name="default",
    ).save_pretrained(adapter)
    async with (
        event_publisher(settings) as publisher,
        llm_gateway_running(settings, tiny_model, model_version=0) as gateway,
    ):
        await publisher.publish(
            TopicKey.MODELS,
            ModelVersion(model_name="fulmen", version=3, uri=str(adapter), format="hf_lora_adapter", adapter="write"),
        )
        async with asyncio.timeout(60):
            while gateway.backend.adapter_version("write") != 3:
                await asyncio.sleep(0.05)
        root = base_url(gateway, "r-9").removesuffix("/v1")
        for agent in ("write", "check"):
            client = AsyncOpenAI(base_url=f"{root}/agent/{agent}/v1", api_key="x", max_retries=0)
            await client.chat.completions.create(model="fulmen", messages=MESSAGES, max_tokens=4)
        async with httpx.AsyncClient() as http:
            bad = await http.post(
                f"{root}/agent/a%20b/v1/chat/completions", json={"model": "fulmen", "messages": MESSAGES}
            )
    assert bad.status_code == 400 and "agent" in bad.json()["error"]["message"]
    write, check = await published_spans(settings, 2)
    assert write["attributes"][semconv.LLM_AGENT] == "write" and write["attributes"][semconv.LLM_ADAPTER] == "write"
    assert write["attributes"][semconv.MODEL_VERSION] == 3 and write["attributes"][semconv.ROLLOUT_ID] == "r-9"
    assert check["attributes"][semconv.LLM_AGENT] == "check"
    assert check["attributes"][semconv.LLM_ADAPTER] == semconv.ADAPTER_NONE == "base"
    assert check["attributes"][semconv.MODEL_VERSION] == 0


async def test_a_seeded_rollout_samples_the_same_tokens_again_call_by_call(
    settings: FulmenSettings, tiny_model: Path
) -> None:
    """Two attempts of a rollout under one seed path: each call's seed comes from (seed, attempt, call number), so
    a rerun (a second gateway, the same rollout seed) samples what the first did; another seed samples otherwise."""
    request = {"model": "fulmen", "messages": MESSAGES, "max_tokens": 16, "temperature": 1.0}

    async def sample(rollout: str, seed: int) -> list[str]:
        async with llm_gateway_running(settings, tiny_model) as gateway:
            url = f"http://127.0.0.1:{gateway.port}/rollout/{rollout}/attempt/1/seed/{seed}/v1"
            client = AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
            return [(await client.chat.completions.create(**request)).choices[0].message.content for _ in range(3)]

    first, again, other = await sample("r-a", 42), await sample("r-b", 42), await sample("r-c", 43)
    assert first == again  # the rollout id is not part of the seed: the dispatcher's seed already names the rollout
    assert first != other
    assert len(set(first)) > 1  # each call of an episode draws with its own seed
    spans = await published_spans(settings, 9)
    seeds = [span["attributes"][semconv.GEN_AI_REQUEST_SEED] for span in spans]
    assert len(set(seeds)) == 6 and seeds[:3] == seeds[3:6]
