"""The calc agent's teacher: what a perfect model answers at each call (``fulmen.warmup``).

Call 1 (the question, no tool result yet): one ``calculator`` call with the task's expression. After the tool's
result (AutoGen's reflection call): the answer, the number alone.
"""

from __future__ import annotations

import json
from typing import Any

from fulmen.testing import Reply, ToolCall

__all__ = ["teach"]


def teach(task: dict[str, Any], messages: list[dict[str, Any]]) -> Reply:
    if not any(message.get("role") == "tool" for message in messages):
        return Reply(tool_calls=(ToolCall("calculator", json.dumps({"expression": task["expression"]})),))
    return Reply(content=str(task["answer"]))
