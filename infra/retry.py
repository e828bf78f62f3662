"""Retrying with backoff: :func:`retrying` awaits a call until it succeeds or a stop event is set, waiting
:func:`backoff_s` (doubling, capped) between attempts. Kafka commits, store inserts, the LLM router and the
consumers' workers all retry through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

__all__ = ["STOPPED", "Stopped", "backoff_s", "retrying"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_MAX_DOUBLINGS = 6  # backoff_s doubles the base at most this often (so the power never overflows)


class Stopped(enum.Enum):
    """What :func:`retrying` returns when its stop event was set before an attempt succeeded."""

    STOPPED = "stopped"


STOPPED = Stopped.STOPPED


def backoff_s(attempt: int, base_s: float, longest_s: float = 30.0) -> float:
    """The wait before retry ``attempt`` (1 after the first failure): ``base_s`` doubled per attempt (at most
    ``_MAX_DOUBLINGS`` times), at most ``longest_s``."""
    return min(longest_s, base_s * 2 ** min(max(attempt, 0), _MAX_DOUBLINGS))


@overload
async def retrying(
    fn: Callable[[], Awaitable[T]],
    *,
    what: str,
    retry_on: tuple[type[BaseException], ...],
    base_s: float,
    longest_s: float = ...,
    stop: None = None,
    logger: logging.Logger = ...,
) -> T: ...


@overload
async def retrying(
    fn: Callable[[], Awaitable[T]],
    *,
    what: str,
    retry_on: tuple[type[BaseException], ...],
    base_s: float,
    longest_s: float = ...,
    stop: asyncio.Event,
    logger: logging.Logger = ...,
) -> T | Stopped: ...


async def retrying(
    fn: Callable[[], Awaitable[T]],
    *,
    what: str,
    retry_on: tuple[type[BaseException], ...],
    base_s: float,
    longest_s: float = 30.0,
    stop: asyncio.Event | None = None,
    logger: logging.Logger = log,
) -> T | Stopped:
    """``await fn()`` until it returns without raising one of ``retry_on`` (anything else propagates), waiting
    :func:`backoff_s` between attempts and logging each failure as a warning. Without ``stop`` it never gives
    up; with it, :data:`STOPPED` once ``stop`` is set before an attempt succeeded (the wait is cut short)."""
    attempt = 0
    while stop is None or not stop.is_set():
        try:
            return await fn()
        except retry_on as exc:
            attempt += 1
            delay = backoff_s(attempt, base_s, longest_s)
            logger.warning("%s failed (attempt %d), retrying in %.1fs: %s", what, attempt, delay, exc)
            if stop is None:
                await asyncio.sleep(delay)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
    return STOPPED
