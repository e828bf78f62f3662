"""The LLM gateway's request parsing is total (400 naming the field, never a crash), its upstream URL's
secrets never reach logs or messages, and ``--model tiny`` builds once (no services)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from fulmen.producers.llm_gateway.backends.upstream import OpenAIUpstreamBackend
from fulmen.producers.llm_gateway.protocol import ApiError, load_body, parse_chat, parse_completion
from fulmen.producers.llm_gateway.settings import LlmSection
from fulmen.producers.llm_gateway.tiny import build_once

pytestmark = pytest.mark.security

USER = [{"role": "user", "content": "hi"}]


def _chat(**fields: object) -> bytes:
    return json.dumps({"model": "m", "messages": USER, **fields}).encode()


def _parse(raw: bytes, chat: bool = True):
    body = load_body(raw)
    return parse_chat(body, max_n=4) if chat else parse_completion(body, max_n=4)


@pytest.mark.parametrize(
    ("raw", "param", "chat"),
    [
        (json.dumps({"model": "m", "prompt": "hi", "logprobs": True}).encode(), "logprobs", False),
        (_chat(stop=5), "stop", True),
        (_chat(stop=1.5), "stop", True),
        (_chat(stop=True), "stop", True),
        (_chat(messages=[{"role": "assistant", "content": "x", "tool_calls": 5}]), "messages.0.tool_calls", True),
        (_chat(messages=[{"role": ["user"], "content": "x"}]), "messages.0.role", True),
        (_chat(messages=[{"role": {"a": 1}, "content": "x"}]), "messages.0.role", True),
        (_chat(messages=[{"role": "user", "content": [{"type": ["text"]}]}]), "messages.0.content", True),
        (
            _chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
            "messages.0.content.0.text",
            True,
        ),
        (_chat(messages=[{"role": "user", "content": "x", "name": 5}]), "messages.0.name", True),
        (_chat(tool_choice=["auto"]), "tool_choice", True),
        (_chat(seed=2**64), "seed", True),
        (_chat(user=-(2**70)), "user", True),
        (_chat(metadata={"a": [1, 2**80]}), "metadata.a.1", True),
        (_chat(max_tokens=10**30), "max_tokens", True),
        (_chat(n=True), "n", True),
        (json.dumps({"model": "m", "prompt": [True, 1]}).encode(), "prompt", False),
        (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content", True),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "\\udfff": 1}', "body", True),
        (b'{"model": "m", "prompt": "x\\udc80y"}', "prompt", False),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "body", True),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 1e400}', "top_p", True),
        (b'{"model": "m", "messages": [], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", "body", True),
        (b'{"model": "m", "messages": [], "x": ' + b"[" * 100 + b"]" * 100 + b"}", "x.0.0.0", True),
        (b'{"model": "m", "messages": [], "seed": ' + b"9" * 5000 + b"}", "body", True),  # past int()'s digit limit
    ],
)
def test_malformed_requests_are_a_400_naming_the_field(raw: bytes, param: str, chat: bool) -> None:
    with pytest.raises(ApiError) as error:
        _parse(raw, chat)
    assert error.value.status == 400
    assert error.value.param is not None and error.value.param.startswith(param), error.value.param
    json.dumps(error.value.body()).encode("utf-8")  # the answer can be sent


def test_tool_call_arguments_that_are_not_servable_json_stay_text() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}
    request = parse_chat({"model": "m", "messages": [*USER, {"role": "assistant", "tool_calls": [call]}]}, max_n=1)
    assert request.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a": "\\ud800"}'


def test_good_requests_still_parse() -> None:
    request = _parse(_chat(stop=["a"], seed=2**63 - 1, metadata={"deep": [[[1]]]}, user="u"))
    assert request.sampling.stop == ("a",) and request.sampling.seed == 2**63 - 1
    assert (
        _parse(json.dumps({"model": "m", "prompt": "hi", "logprobs": 2}).encode(), chat=False).sampling.top_logprobs
        == 2
    )


async def test_upstream_credentials_never_reach_logs_or_messages(caplog: pytest.LogCaptureFixture) -> None:
    url = "http://agent:hunter2@127.0.0.1:9/v1?api_key=abcdef"  # port 9 (discard): nothing listens
    backend = OpenAIUpstreamBackend(LlmSection(backend="openai", upstream_url=url, upstream_timeout_s=5))
    caplog.set_level(logging.DEBUG)
    try:
        await backend.start()
        with pytest.raises(ApiError) as error:
            await backend._post("/chat/completions", {"model": "m", "messages": USER}, backend.serving)
    finally:
        await backend.close()
    shown = caplog.text + error.value.message
    assert "127.0.0.1:9" in caplog.text  # the warning was logged, with the host
    assert "hunter2" not in shown and "abcdef" not in shown


def test_tiny_model_is_built_once(tmp_path: Path) -> None:
    calls: list[Path] = []

    def build(directory: Path) -> Path:
        calls.append(directory)
        (directory / "config.json").write_text("{}")
        return directory

    target = tmp_path / "models" / "tiny"
    assert build_once(target, build) == target and (target / "config.json").is_file()
    assert build_once(target, build) == target
    assert len(calls) == 1 and not list(target.parent.glob(".tiny-*"))  # no staging directory left


@pytest.mark.parametrize("attempt", ["\u00b2", "9" * 5000, "0", "-1", "1.0", "\u0661"])
def test_a_rollout_path_attempt_that_is_not_a_small_positive_integer_is_a_400(attempt: str) -> None:
    from fulmen.producers.llm_gateway.app import _rollout

    class _Request:
        match_info = {"rollout_id": "r1", "attempt": attempt}  # noqa: RUF012

    with pytest.raises(ApiError) as error:
        _rollout(_Request())  # type: ignore[arg-type]
    assert error.value.status == 400 and error.value.param == "attempt"
