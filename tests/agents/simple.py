"""Agents for the runner tests. Each is ``(task, llm)`` and returns a reward or None, like a user's agent."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from opentelemetry import trace

tracer = trace.get_tracer("tests.agents")


def echo_reward(task: dict, llm: object) -> float:
    """Sync: one span of its own, then the reward the task asks for."""
    with tracer.start_as_current_span("think", attributes={"base_url": llm.base_url}):
        time.sleep(task.get("sleep", 0))
    return float(task.get("reward", 1.0))


async def async_echo(task: dict, llm: object) -> float | None:
    await asyncio.sleep(task.get("sleep", 0))
    return task.get("reward")


def flaky(task: dict, llm: object) -> float:
    """Fails on the first attempt of every rollout (it keeps a marker file per task), then succeeds."""
    marker = Path(task["dir"]) / f"{task['name']}.tried"
    if not marker.exists():
        marker.write_text("1")
        raise RuntimeError("first try fails")
    return 1.0


def always_fails(task: dict, llm: object) -> float:
    raise ValueError("this agent always fails")


def returns_text(task: dict, llm: object) -> str:
    return "not a reward"


def slow_once(task: dict, llm: object) -> float:
    """Sleeps long on its first attempt (to be killed or timed out), quick on later ones."""
    marker = Path(task["dir"]) / f"{task['name']}.started"
    first = not marker.exists()
    marker.write_text(str(os.getpid()))
    time.sleep(task["first_sleep"] if first else 0)
    return 1.0
