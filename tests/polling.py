"""Waiting in tests for something that happens asynchronously (a consumer storing rows), with a deadline."""

from __future__ import annotations

import asyncio
import time
from typing import Any


async def count_reaches(reader: Any, sql: str, expected: int, timeout_s: float = 30, every_s: float = 0.1) -> int:
    """Run ``SELECT count() ...`` through ``reader.query`` until it reaches ``expected`` or time is up; the
    last count (so the caller's assertion shows how far it got)."""
    deadline = time.monotonic() + timeout_s
    while True:
        count = (await asyncio.to_thread(reader.query, sql)).rows[0][0]
        if count >= expected or time.monotonic() > deadline:
            return count
        await asyncio.sleep(every_s)
