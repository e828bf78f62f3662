"""The demo agent: a plain async function using the official ``openai`` client, as a user would write it.

Episode (two LLM calls, the first decides what the second sees):

1. the question, with one tool ``calc`` (compact schema: the tiny model pays per prompt character); the
   model should answer ``<tool_call>{"name": "calc", "arguments": {"expr": "17+3"}}</tool_call>``, which the
   gateway returns as an OpenAI ``tool_calls`` entry;
2. the agent evaluates the expression safely (:func:`fulmen.algorithm.demo.calc.evaluate`), sends the result as the
   tool message, and the model answers with the number.

Reward (the return value): 1.0 when the final answer's first integer equals ``task["answer"]``, else 0.0 (also
when there is no valid tool call). Held-out tasks carry ``"greedy": true``: temperature 0 there, 1 in training.
"""

from __future__ import annotations

import json
import re
from typing import Any

from openai import AsyncOpenAI

from fulmen.algorithm.demo.calc import CalcError, evaluate

__all__ = ["SYSTEM", "TOOLS", "solve"]

TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "calc", "parameters": {"expr": "str"}}}]
SYSTEM = ""  # the tools are the whole system turn
CALL_TOKENS = 64
ANSWER_TOKENS = 8

_INTEGER = re.compile(r"-?\d+")


async def solve(task: dict[str, Any], llm: Any) -> float:
    """Run one episode of ``task`` (see the module docstring) against ``llm``; the reward."""
    temperature = 0.0 if task.get("greedy") else 1.0
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]
    async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=2) as client:
        first = await client.chat.completions.create(
            model=llm.model, messages=messages, tools=TOOLS, max_tokens=CALL_TOKENS, temperature=temperature
        )
        call = _calc_call(first.choices[0].message)
        if call is None:
            return 0.0
        call_id, arguments, value = call
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": "calc", "arguments": arguments}}
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": value})
        second = await client.chat.completions.create(
            model=llm.model, messages=messages, tools=TOOLS, max_tokens=ANSWER_TOKENS, temperature=temperature
        )
    found = _INTEGER.search(second.choices[0].message.content or "")
    return 1.0 if found is not None and int(found.group()) == int(task["answer"]) else 0.0


def _calc_call(message: Any) -> tuple[str, str, str] | None:
    """``(call id, arguments JSON, tool result text)`` of the first ``calc`` call, or None without a valid one."""
    for call in message.tool_calls or []:
        if call.function.name != "calc":
            continue
        try:
            expr = json.loads(call.function.arguments).get("expr")
            return call.id, call.function.arguments, str(evaluate(expr))
        except (ValueError, AttributeError, CalcError):
            return None
    return None
