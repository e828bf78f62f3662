"""A scripted OpenAI-compatible server, for testing an agent without a model and for recording demonstrations.

:class:`ScriptedOpenAI` serves ``POST .../v1/chat/completions`` (plain JSON, or ``stream: true`` as Server-Sent
Events: ``data: {chunk}`` lines, then ``data: [DONE]``) and ``GET .../v1/models`` under any path prefix, so an
agent can be pointed at ``{url}/rollout/<id>/attempt/<n>/v1`` exactly as at the Fulmen LLM gateway. What each
request gets back is chosen by a *script*, a function ``(RecordedRequest) -> Reply`` (the request's path and
body are there: a script can answer by the path's prefix, e.g. which task an agent is working on).

The server runs its own event loop in a daemon thread (use it as a context manager), so sync agents, async
agents and the caller can all reach it. Every request is kept in :attr:`ScriptedOpenAI.requests` with its path,
headers, JSON body, the id of the completion it got back and the reply. A script that raises is answered with
a 500 whose message names the exception (the agent sees an API error, as with a failing upstream).

    with ScriptedOpenAI(lambda request: Reply(content="4")) as server:
        client = openai.OpenAI(base_url=server.url(), api_key="x")
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

__all__ = ["RecordedRequest", "Reply", "Script", "ScriptedOpenAI", "ToolCall", "completion_json", "stream_chunks"]


@dataclass(frozen=True)
class ToolCall:
    """One tool call as an OpenAI server returns it."""

    name: str
    arguments: str  # JSON text, as OpenAI sends it (a script may send text that is not JSON)


@dataclass(frozen=True)
class Reply:
    """One assistant message: text, tool calls, or both."""

    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class RecordedRequest:
    """What the server received (path with any prefix, headers with lower-cased keys, JSON body), the ``id`` of
    the completion it answered with (``chatcmpl-...``, the same in every chunk of a stream) and the reply (None
    when the script failed)."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    response_id: str
    reply: Reply | None = None


Script = Callable[[RecordedRequest], Reply]


def _tool_call_json(call: ToolCall, index: int) -> dict[str, Any]:
    return {
        "index": index,
        "id": f"call_{uuid.uuid4().hex[:12]}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


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
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", "scripted"),
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if reply.tool_calls else "stop",
                "logprobs": None,
            }
        ],
        "usage": _usage(body, reply),
    }


def stream_chunks(body: dict[str, Any], reply: Reply, response_id: str) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects for ``reply``: role, text in pieces, tool calls, finish, usage."""
    base = {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": body.get("model", "scripted"),
    }
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


class ScriptedOpenAI:
    """The server, on ``127.0.0.1`` and a free port, for the life of a ``with`` block.

    ``url(prefix)`` gives a base URL such as ``http://127.0.0.1:PORT/rollout/r1/attempt/1/v1``.
    """

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[RecordedRequest] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="scripted-openai", daemon=True)
        self._runner: web.AppRunner | None = None

    def url(self, prefix: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{prefix}/v1"

    def chat_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]

    def __enter__(self) -> ScriptedOpenAI:
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
        return web.json_response(
            {"object": "list", "data": [{"id": "scripted", "object": "model", "owned_by": "fulmen"}]}
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        headers = {key.lower(): value for key, value in request.headers.items()}
        recorded = RecordedRequest(request.path, headers, body, f"chatcmpl-{uuid.uuid4().hex[:16]}")
        try:
            reply = self.script(recorded)
        except Exception as exc:  # the script's bug or refusal: the agent sees a server error, the caller a record
            self.requests.append(recorded)
            return web.json_response({"error": {"message": f"script failed: {type(exc).__name__}: {exc}"}}, status=500)
        self.requests.append(RecordedRequest(recorded.path, headers, body, recorded.response_id, reply))
        if not body.get("stream"):
            return web.json_response(completion_json(body, reply, recorded.response_id))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for chunk in stream_chunks(body, reply, recorded.response_id):
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
