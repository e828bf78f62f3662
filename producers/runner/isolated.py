"""One sync agent call in a process of its own (``FULMEN_RUNNER_SYNC_ISOLATION=process``).

Reads one JSON object on stdin (the agent's path, the runner's ``sys.path``, the task, the LLM endpoint, the
rollout request, the rollout span's trace context, the OTLP endpoint), runs the agent under the rollout's span
context with rollout attributes stamped on its spans, flushes them, and writes one JSON object to the original
stdout: ``{"reward": r}`` or ``{"error": "..."}``. What the agent prints goes to stderr. The runner kills this
process (its whole process group) when the rollout times out.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys
from typing import Any

from opentelemetry import context, propagate


def _call(payload: dict[str, Any]) -> dict[str, Any]:
    from fulmen.producers.runner.agent import AgentError, LLMEndpoint, check_reward, load_agent
    from fulmen.producers.runner.tracing import CURRENT_ROLLOUT, build_tracer_provider, flush_all
    from fulmen.schemas.events import RolloutRequest

    provider = build_tracer_provider(payload.get("otlp_endpoint") or None)
    request = payload.get("request")
    if request is not None:
        CURRENT_ROLLOUT.set(RolloutRequest.model_validate(request))
    token = context.attach(propagate.extract(payload.get("carrier") or {}))
    try:
        agent = load_agent(payload["agent"])
        result = agent(payload["task"], LLMEndpoint(**payload["llm"]))
        if inspect.isawaitable(result):
            result = asyncio.run(_awaited(result))
        return {"reward": check_reward(result)}
    except AgentError as exc:
        return {"error": str(exc)}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        context.detach(token)
        flush_all(provider)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def main() -> None:
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the agent's prints go to stderr; stdout carries only the reply
    payload = json.loads(sys.stdin.read())
    sys.path[:0] = [entry for entry in payload.get("sys_path", []) if entry not in sys.path]
    reply = _call(payload)
    out.write(json.dumps(reply))
    out.flush()


if __name__ == "__main__":
    main()
