"""The agent ``bench/chaos.py`` has the runner run: two short LLM calls and one span of its own per rollout.

It is a plain async agent with the official ``openai`` client (retries as the client does by default), so a
killed LLM gateway or runner shows up the way it would for a user's agent: a failed call fails the attempt and
the runner retries it. Every call the gateway answered with a 200 is appended to the JSONL file named by
``CHAOS_CALLS_FILE`` (``{"id": <response id>, "t": <unix time>, "rollout": ..., "attempt": ...}``): the chaos
bench checks that each of them has exactly one span in the store. The reward is 1.0 when the second reply is
longer than the first, else 0.0 (so GRPO groups get non-zero advantages).
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

from openai import AsyncOpenAI
from opentelemetry import trace

__all__ = ["run"]

_tracer = trace.get_tracer("fulmen.bench.chaos")
_SCOPED = re.compile(r"/rollout/([^/]+)/attempt/(\d+)/")
MAX_TOKENS = 6


def _record(response_id: str, base_url: str) -> None:
    path = os.environ.get("CHAOS_CALLS_FILE")
    if not path:
        return
    found = _SCOPED.search(base_url)
    line = {
        "id": response_id,
        "t": time.time(),
        "rollout": found.group(1) if found else "",
        "attempt": int(found.group(2)) if found else 0,
    }
    with open(path, "a", encoding="utf-8") as out:  # one short line per write: appends do not interleave
        out.write(json.dumps(line) + "\n")


async def run(task: dict[str, Any], llm: Any) -> float:
    """One episode: ask ``task["question"]`` twice (the second call sees the first answer); the reward."""
    lengths = []
    messages: list[dict[str, Any]] = [{"role": "user", "content": str(task.get("question", "hi"))}]
    async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, timeout=30.0) as client:
        for step in range(2):
            with _tracer.start_as_current_span(f"chaos step {step}") as span:
                span.set_attribute("chaos.step", step)
                reply = await client.chat.completions.create(
                    model=llm.model, messages=messages, max_tokens=MAX_TOKENS, temperature=1.0
                )
            _record(reply.id, str(llm.base_url))
            text = reply.choices[0].message.content or ""
            lengths.append(len(text))
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "and then?"}]
    return 1.0 if lengths[1] > lengths[0] else 0.0
