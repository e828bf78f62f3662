"""Loading the user's agent (``module:function``) and calling it the same way whether it is sync or async.

The agent is called as ``agent(task, llm)``: ``task`` is the request's ``input`` dict, ``llm`` an
:class:`LLMEndpoint` whose ``base_url`` is scoped to the rollout (so the LLM gateway ties every call to it with
no header or SDK). It returns the episode reward as a number, or None when it has none to give.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import IDENTIFIER_PATTERN

_AGENT_SUFFIX = re.compile(r"/agent/[^/]+$")

__all__ = ["AgentError", "LLMEndpoint", "call_agent", "check_reward", "load_agent"]


@dataclass(frozen=True)
class LLMEndpoint:
    """What an agent needs to reach the LLM gateway: pass these to ``openai.OpenAI(...)``."""

    base_url: str
    model: str
    api_key: str = "fulmen"

    def for_agent(self, name: str) -> LLMEndpoint:
        """The endpoint for one agent of a multi-agent workflow: its calls name it (``.../agent/{name}/v1``), so
        the gateway serves that agent's own adapter when it has one (``FULMEN_TRAIN_ADAPTERS=per_agent``) and the
        model otherwise; its spans record the agent either way."""
        if not IDENTIFIER_PATTERN.fullmatch(name):
            raise ConfigurationError(f"agent name {name!r}: use letters, digits and . _ : - (at most 128)")
        root = _AGENT_SUFFIX.sub("", self.base_url.rstrip("/").removesuffix("/v1"))  # another agent's: replaced
        return dataclasses.replace(self, base_url=f"{root}/agent/{name}/v1")


class AgentError(Exception):
    """The agent raised, or returned something that is not a reward."""


def load_agent(path: str) -> Callable[..., Any]:
    """Import ``module:function``; a wrong path is a :class:`ConfigurationError` that says what is wrong."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(f"--agent must look like package.module:function, not {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(
            f"cannot import the agent module {module_name!r} ({exc}); is it on PYTHONPATH?"
        ) from exc
    target: Any = module
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigurationError(f"module {module_name!r} has no {attribute!r} (from --agent {path})")
    if not callable(target):
        raise ConfigurationError(f"--agent {path} is a {type(target).__name__}, not a function")
    return target


async def call_agent(agent: Callable[..., Any], task: dict[str, Any], llm: LLMEndpoint) -> float | None:
    """Run the agent (a sync agent in a worker thread, so rollouts stay concurrent) and check its result."""
    try:
        if inspect.iscoroutinefunction(agent):
            result = await agent(task, llm)
        else:
            result = await asyncio.to_thread(agent, task, llm)
            if inspect.isawaitable(result):
                result = await result
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        raise AgentError(f"{type(exc).__name__}: {exc}") from exc
    return check_reward(result)


def check_reward(result: Any) -> float | None:
    """The agent's result as a reward; anything but a finite number or None is an :class:`AgentError`."""
    if result is None:
        return None
    if isinstance(result, bool) or not isinstance(result, int | float) or not math.isfinite(result):
        raise AgentError(f"the agent returned {result!r}; it must return a finite number (the reward) or None")
    return float(result)
