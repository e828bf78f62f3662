"""OpenAI response bodies built from a :class:`CallResult`: whole responses and server-sent-event chunks.

A streamed answer carries exactly the tokens of the non-streamed one: the gateway generates the whole
answer, records its span, then streams it as chunks (role, then one chunk per token of content, tool calls
as one chunk, the finish reason, optionally usage, then ``[DONE]``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from fulmen.producers.llm_gateway.backends.base import CallResult, Choice, TokenLogprob

__all__ = ["chat_chunks", "chat_response", "completion_chunks", "completion_response", "sse"]


def _usage(result: CallResult) -> dict[str, int]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def _chat_logprobs(tokens: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if tokens is None:
        return None
    return {
        "content": [
            {
                "token": t.token,
                "logprob": t.logprob,
                "bytes": list(t.token.encode()),
                "top_logprobs": [{"token": s, "logprob": v, "bytes": list(s.encode())} for s, v in t.top],
            }
            for t in tokens
        ]
    }


def _message(choice: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": choice.text or None if choice.tool_calls else choice.text,
    }
    if choice.tool_calls:
        message["tool_calls"] = choice.tool_calls
    return message


def chat_response(result: CallResult) -> dict[str, Any]:
    return {
        "id": result.id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": result.model,
        "choices": [
            {
                "index": c.index,
                "message": _message(c),
                "finish_reason": c.finish_reason,
                "logprobs": _chat_logprobs(c.token_logprobs),
            }
            for c in result.choices
        ],
        "usage": _usage(result),
        "system_fingerprint": _fingerprint(result),
    }


def chat_chunks(result: CallResult, include_usage: bool) -> Iterator[dict[str, Any]]:
    created = int(time.time())

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return {
            "id": result.id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": result.model,
            "system_fingerprint": _fingerprint(result),
            "choices": [choice],
        }

    for choice in result.choices:
        yield chunk(choice.index, {"role": "assistant", "content": ""})
        for piece, tokens in _pieces(choice):
            yield chunk(choice.index, {"content": piece}, logprobs=_chat_logprobs(tokens))
        if choice.tool_calls:
            calls = [{"index": i, **call} for i, call in enumerate(choice.tool_calls)]
            yield chunk(choice.index, {"tool_calls": calls})
        yield chunk(choice.index, {}, choice.finish_reason)
    if include_usage:
        yield {
            "id": result.id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": result.model,
            "choices": [],
            "usage": _usage(result),
        }


def _pieces(choice: Choice) -> Iterator[tuple[str, list[TokenLogprob] | None]]:
    """The content as it grew token by token (with each token's logprob), when the backend says how; else
    the whole content in one piece."""
    tokens = choice.token_logprobs
    if choice.pieces is not None and not choice.tool_calls and "".join(choice.pieces) == choice.text:
        for index, piece in enumerate(choice.pieces):
            if piece or tokens:
                yield piece, [tokens[index]] if tokens else None
        return
    if choice.text or tokens:
        yield choice.text, tokens


def completion_response(result: CallResult) -> dict[str, Any]:
    return {
        "id": result.id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": result.model,
        "choices": [
            {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": _text_logprobs(c)}
            for c in result.choices
        ],
        "usage": _usage(result),
        "system_fingerprint": _fingerprint(result),
    }


def completion_chunks(result: CallResult, include_usage: bool) -> Iterator[dict[str, Any]]:
    created = int(time.time())
    for choice in result.choices:
        body = {
            "index": choice.index,
            "text": choice.text,
            "finish_reason": choice.finish_reason,
            "logprobs": _text_logprobs(choice),
        }
        yield {
            "id": result.id,
            "object": "text_completion",
            "created": created,
            "model": result.model,
            "choices": [body],
        }
    if include_usage:
        yield {
            "id": result.id,
            "object": "text_completion",
            "created": created,
            "model": result.model,
            "choices": [],
            "usage": _usage(result),
        }


def _text_logprobs(choice: Choice) -> dict[str, Any] | None:
    if choice.token_logprobs is None:
        return None
    offsets, position = [], 0
    for token in choice.token_logprobs:
        offsets.append(position)
        position += len(token.token)
    return {
        "tokens": [t.token for t in choice.token_logprobs],
        "token_logprobs": [t.logprob for t in choice.token_logprobs],
        "top_logprobs": [dict(t.top) for t in choice.token_logprobs],
        "text_offset": offsets,
    }


def _fingerprint(result: CallResult) -> str | None:
    return None if result.model_version is None else f"fulmen-v{result.model_version}"


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()
