"""The LLM gateway's request parsing, tool-call extraction, traceparent and response shapes (no services)."""

from __future__ import annotations

import json

import pytest

from fulmen.producers.llm_gateway.backends.base import CallResult, Choice, TokenLogprob
from fulmen.producers.llm_gateway.protocol import ApiError, parse_chat, parse_completion
from fulmen.producers.llm_gateway.responses import chat_chunks, chat_response
from fulmen.producers.llm_gateway.spans import parse_traceparent
from fulmen.producers.llm_gateway.tool_calls import extract_tool_calls

USER = [{"role": "user", "content": "hi"}]


def test_chat_request_is_normalised() -> None:
    request = parse_chat(
        {
            "model": "m",
            "max_completion_tokens": 7,
            "stop": "x",
            "seed": 3,
            "n": 2,
            "temperature": 0,
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "user", "content": "q", "name": "ann"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
                },
                {"role": "tool", "tool_call_id": "c", "content": "2"},
            ],
            "tools": [{"type": "function", "function": {"name": "f", "strict": True}}],
            "tool_choice": "auto",
            "user": "ignored",
            "parallel_tool_calls": True,
            "stream_options": {"include_usage": True},
        },
        max_n=4,
    )
    assert request.messages[0] == {"role": "system", "content": "ab"}
    assert request.messages[1]["name"] == "ann"
    assert request.messages[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert request.sampling.max_tokens == 7 and request.sampling.stop == ("x",) and request.sampling.n == 2
    assert request.parse_tool_calls and not request.include_usage  # usage chunks only when streaming


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": USER}, "model"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
        ({"model": "m", "messages": USER, "temperature": 2.5}, "temperature"),
        ({"model": "m", "messages": USER, "top_p": 0}, "top_p"),
        ({"model": "m", "messages": USER, "n": 9}, "n"),
        ({"model": "m", "messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "m", "messages": USER, "top_logprobs": 2}, "top_logprobs"),
        ({"model": "m", "messages": USER, "tools": [{"type": "function"}]}, "tools.0"),
        (
            {
                "model": "m",
                "messages": USER,
                "tools": [{"function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        ({"model": "m", "messages": USER, "stream": "yes"}, "stream"),
    ],
)
def test_bad_chat_requests_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as error:
        parse_chat(body, max_n=8)
    assert error.value.status == 400 and error.value.param == param
    assert error.value.body()["error"]["type"] == "invalid_request_error"


def test_completion_prompts() -> None:
    assert parse_completion({"model": "m", "prompt": [1, 2]}, 4).prompt_token_ids == [1, 2]
    assert parse_completion({"model": "m", "prompt": ["text"]}, 4).prompt == "text"
    assert parse_completion({"model": "m", "prompt": "x"}, 4).sampling.max_tokens == 16  # OpenAI's default
    with pytest.raises(ApiError, match="one prompt per request"):
        parse_completion({"model": "m", "prompt": ["a", "b"]}, 4)
    with pytest.raises(ApiError, match="logprobs"):
        parse_completion({"model": "m", "prompt": "a", "logprobs": 21}, 4)


def test_tool_calls_are_extracted_and_bad_ones_stay_text() -> None:
    text, calls = extract_tool_calls('Sure. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    assert text == "Sure." and calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    two = extract_tool_calls(
        '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b", "arguments": "{}"}</tool_call>'
    )
    assert [c["function"]["name"] for c in two[1]] == ["a", "b"] and two[0] == ""
    for bad in ["<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>{}"]:
        assert extract_tool_calls(bad) == (bad, [])


def test_traceparent() -> None:
    parent = parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    assert parent is not None and parent.trace_id.hex() == "4bf92f3577b34da6a3ce929d0e0e4736"
    for bad in [
        None,
        "",
        "garbage",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
    ]:
        assert parse_traceparent(bad) is None


def test_stream_chunks_add_up_to_the_response() -> None:
    tokens = [TokenLogprob("He", -0.1), TokenLogprob("", -0.2), TokenLogprob("llo", -0.3)]
    result = CallResult(
        "id", "m", [Choice(0, "Hello", "stop", [1, 2, 3], [-0.1, -0.2, -0.3], [], tokens, ["He", "", "llo"])], [9], 1, 3
    )
    chunks = list(chat_chunks(result, include_usage=True))
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    logprobs = [
        lp["logprob"]
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for lp in c["choices"][0]["logprobs"]["content"]
    ]
    whole = chat_response(result)
    assert content == whole["choices"][0]["message"]["content"] == "Hello"
    assert logprobs == [-0.1, -0.2, -0.3]
    assert chunks[-1]["usage"] == whole["usage"] and chunks[-2]["choices"][0]["finish_reason"] == "stop"
    json.dumps(chunks)  # every chunk is JSON
