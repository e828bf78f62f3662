"""Tool calls written in a model's text (Hermes / Qwen2.5 style) turned into OpenAI ``tool_calls``.

The chat templates of Qwen2.5, Hermes and our tiny model ask the model to write
``<tool_call>{"name": "...", "arguments": {...}}</tool_call>``. A block whose JSON does not parse, or lacks a
name, stays in the text: the agent sees what the model wrote rather than a call that was never made.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

__all__ = ["extract_tool_calls"]

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def extract_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """``(text outside the calls, calls)``; each call is ``{"id", "type": "function", "function": {name,
    arguments}}`` with ``arguments`` a JSON string, as OpenAI returns it."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        call = _parse(match.group(1))
        if call is None:
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(call)
    kept.append(text[position:])
    return "".join(kept).strip() if calls else text, calls


def _parse(body: str) -> dict[str, Any] | None:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except json.JSONDecodeError:
            return None
    else:
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": data["name"], "arguments": arguments},
    }
