"""A stand-in OpenAI-compatible server for the framework agents' tests: scripted replies, every request recorded.

Serves ``POST .../v1/chat/completions`` (plain JSON, or ``stream: true`` as Server-Sent Events: ``data: {chunk}``
lines, then ``data: [DONE]``) and ``GET .../v1/models``, under any path prefix, so an agent can be pointed at
``{base}/rollout/<id>/attempt/<n>/v1`` exactly as at the Fulmen LLM gateway.

What each request gets back is chosen by a *script*, a function ``(request body) -> Reply``, picked by name from
:data:`SCRIPTS`:

* ``tool_then_text``: when the request offers tools and no tool result has come back since the last user
  message, a call of the first offered tool with arguments made from its JSON schema (integer → 2, number →
  2.0, boolean → true, anything else → "x"); otherwise a short sentence.
* ``garbage``: what a tiny untrained model behind the gateway gives: noise text, and, when tools are offered,
  a call of a tool that does not exist with arguments that are not JSON.
* ``bad_arguments``: when tools are offered, always a call of the first one with arguments that are not JSON
  (an agent that retries on tool errors loops until its turn limit); otherwise noise text.

The server runs its own event loop in a daemon thread (:class:`FakeOpenAI` is a context manager), so sync
agents, async agents and the test itself can all reach it. Every request is kept in
:attr:`FakeOpenAI.requests` with its path, headers, JSON body and the id of the completion it got back.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

__all__ = ["SCRIPTS", "FakeOpenAI", "RecordedRequest", "Reply", "ToolCall"]

GARBAGE_TEXT = "qz<tool_call>{{ xx 7 ]] lorem</tool_call"


@dataclass(frozen=True)
class ToolCall:
    """One tool call as the gateway returns it after parsing ``<tool_call>{...}</tool_call>``."""

    name: str
    arguments: str  # JSON text as OpenAI sends it (the garbage script sends text that is not JSON)


@dataclass(frozen=True)
class Reply:
    """One assistant message: text, tool calls, or both."""

    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class RecordedRequest:
    """What the server received (path with any rollout prefix, headers with lower-cased keys, body) and the
    ``id`` of the completion it answered with (``chatcmpl-...``, the same in every chunk of a stream)."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    response_id: str


def _placeholder(schema: dict[str, Any]) -> Any:
    kind = schema.get("type")
    return {"integer": 2, "number": 2.0, "boolean": True}.get(kind, "x") if isinstance(kind, str) else "x"


def _tool_was_answered(messages: list[dict[str, Any]]) -> bool:
    for message in reversed(messages):
        if message.get("role") == "tool":
            return True
        if message.get("role") == "user":
            return False
    return False


def tool_then_text(body: dict[str, Any]) -> Reply:
    """First offered tool with placeholder arguments, then (after its result) a sentence."""
    tools = body.get("tools") or []
    if not tools or _tool_was_answered(body.get("messages") or []):
        return Reply(content="The answer is 4. It reads well.")
    function = tools[0].get("function", {})
    properties = function.get("parameters", {}).get("properties", {})
    arguments = {name: _placeholder(schema) for name, schema in properties.items()}
    return Reply(tool_calls=(ToolCall(function.get("name", "unknown"), json.dumps(arguments)),))


def garbage(body: dict[str, Any]) -> Reply:
    """Noise text; with tools offered, also a call of an unknown tool with arguments that are not JSON."""
    if body.get("tools"):
        return Reply(content=GARBAGE_TEXT, tool_calls=(ToolCall("no_such_tool", "{not json"),))
    return Reply(content=GARBAGE_TEXT)


def bad_arguments(body: dict[str, Any]) -> Reply:
    """A call of the first offered tool with arguments that are not JSON, every time; noise without tools."""
    tools = body.get("tools") or []
    if not tools:
        return Reply(content=GARBAGE_TEXT)
    return Reply(tool_calls=(ToolCall(tools[0].get("function", {}).get("name", "unknown"), "{a: 2, b:"),))


SCRIPTS: dict[str, Callable[[dict[str, Any]], Reply]] = {
    "tool_then_text": tool_then_text, "garbage": garbage, "bad_arguments": bad_arguments,
}  # fmt: skip


def _tool_call_json(call: ToolCall, index: int) -> dict[str, Any]:
    return {
        "index": index, "id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }  # fmt: skip


def _usage(body: dict[str, Any], reply: Reply) -> dict[str, int]:
    prompt = len(json.dumps(body.get("messages", []))) // 4
    completion = len(reply.content or "") // 4 + 8 * len(reply.tool_calls)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_json(body: dict[str, Any], reply: Reply, response_id: str) -> dict[str, Any]:
    """The non-streaming ``chat.completion`` object for ``reply``."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [_tool_call_json(call, i) for i, call in enumerate(reply.tool_calls)]
    return {
        "id": response_id, "object": "chat.completion", "created": int(time.time()),
        "model": body.get("model", "fake"),
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if reply.tool_calls else "stop",
                     "logprobs": None}],
        "usage": _usage(body, reply),
    }  # fmt: skip


def stream_chunks(body: dict[str, Any], reply: Reply, response_id: str) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects for ``reply``: role, text in pieces, tool calls, finish, usage."""
    base = {"id": response_id, "object": "chat.completion.chunk",
            "created": int(time.time()), "model": body.get("model", "fake")}  # fmt: skip
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    text = reply.content or ""
    deltas += [{"content": text[i : i + 8]} for i in range(0, len(text), 8)]
    deltas += [{"tool_calls": [_tool_call_json(call, i)]} for i, call in enumerate(reply.tool_calls)]
    chunks = [{**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]} for delta in deltas]
    finish = "tool_calls" if reply.tool_calls else "stop"
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({**base, "choices": [], "usage": _usage(body, reply)})
    return chunks


class FakeOpenAI:
    """The server, on ``127.0.0.1`` and a free port, for the life of a ``with`` block.

    ``url(prefix)`` gives a base URL such as ``http://127.0.0.1:PORT/rollout/r1/attempt/1/v1``.
    """

    def __init__(self, script: str = "tool_then_text") -> None:
        if script not in SCRIPTS:
            raise ValueError(f"unknown script {script!r}; known: {sorted(SCRIPTS)}")
        self.script = SCRIPTS[script]
        self.requests: list[RecordedRequest] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-openai", daemon=True)
        self._runner: web.AppRunner | None = None

    def url(self, prefix: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{prefix}/v1"

    def chat_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]

    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/{prefix:.*}v1/chat/completions", self._chat)
        app.router.add_get("/{prefix:.*}v1/models", self._models)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the port the OS picked

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "fulmen"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        headers = {key.lower(): value for key, value in request.headers.items()}
        response_id = f"chatcmpl-{uuid.uuid4().hex[:16]}"
        self.requests.append(RecordedRequest(request.path, headers, body, response_id))
        reply = self.script(body)
        if not body.get("stream"):
            return web.json_response(completion_json(body, reply, response_id))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for chunk in stream_chunks(body, reply, response_id):
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
