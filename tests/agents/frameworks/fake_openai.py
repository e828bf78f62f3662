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

The server is :class:`fulmen.testing.ScriptedOpenAI` (its own event loop in a daemon thread, every request kept
in ``requests``); :class:`FakeOpenAI` picks its script by name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fulmen.testing import RecordedRequest, Reply, ScriptedOpenAI, ToolCall, completion_json, stream_chunks

__all__ = ["SCRIPTS", "FakeOpenAI", "RecordedRequest", "Reply", "ToolCall", "completion_json", "stream_chunks"]

GARBAGE_TEXT = "qz<tool_call>{{ xx 7 ]] lorem</tool_call"


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
    "tool_then_text": tool_then_text,
    "garbage": garbage,
    "bad_arguments": bad_arguments,
}


class FakeOpenAI(ScriptedOpenAI):
    """The stand-in server answering with the script named ``script`` (looked up in :data:`SCRIPTS` per request,
    so a test may add one with ``monkeypatch.setitem``)."""

    def __init__(self, script: str = "tool_then_text") -> None:
        if script not in SCRIPTS:
            raise ValueError(f"unknown script {script!r}; known: {sorted(SCRIPTS)}")
        super().__init__(lambda request: SCRIPTS[script](request.body))
