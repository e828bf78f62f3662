"""The demo's agent behind a heavy-tailed delay, for ``bench/async_vs_sync.py``: most rollouts wait ``QUICK_S``
(jittered), one in ten ``SLOW_FACTOR`` times as long, as agents whose tools or environments are sometimes slow.

The draw is made from the rollout's own base URL (it holds the rollout id), so every rollout, and every attempt,
keeps its delay; the delay comes before the episode's LLM calls. ``STRAGGLER_QUICK_S`` sets the quick delay.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

from fulmen.algorithm.demo.agent import solve as solve_demo

__all__ = ["SLOW_FACTOR", "SLOW_SHARE", "delay_s", "solve"]

SLOW_SHARE = 0.1
SLOW_FACTOR = 10.0


def delay_s(key: str, quick_s: float) -> float:
    """The delay of the rollout keyed ``key``: ``quick_s`` or ``SLOW_FACTOR`` times it, times 0.75-1.25."""
    digest = hashlib.sha256(key.encode()).digest()
    factor = SLOW_FACTOR if digest[0] < 256 * SLOW_SHARE else 1.0
    return quick_s * factor * (0.75 + digest[1] / 512)


async def solve(task: dict[str, Any], llm: Any) -> float:
    await asyncio.sleep(delay_s(llm.base_url, float(os.environ.get("STRAGGLER_QUICK_S", "1.0"))))
    return await solve_demo(task, llm)
