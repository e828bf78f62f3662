"""When a retried attempt may start: an exponential backoff carried on the retry request as a not-before time.

A failed or timed-out attempt is retried by publishing the next attempt's request to the tasks topic. Started
at once, retries burn out during an outage (an LLM gateway down for two minutes failed every attempt of half
the rollouts). So the retry carries the earliest time it may start, ``base * 2 ** (attempt - 1)`` seconds
after the failure, at most ``cap``, plus up to ``jitter`` of that at random (retries after an outage spread
out instead of arriving together). It travels in the request's ``metadata`` under :data:`NOT_BEFORE_KEY` (an
ISO 8601 UTC time; the request schema has no field of its own for it), so whichever runner takes the request
(after a rebalance or a restart too) honours it.

A runner that takes a request whose time has not come holds it in :class:`DelayedRequests` (its offset stays
uncommitted, so nothing is lost if the runner dies) and goes on running other requests; the held request starts
when it is due and a slot is free. A runner never holds a request longer than ``cap`` plus jitter from when it
took it, whatever time the request names.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Generic, TypeVar

from fulmen.schemas.events import RolloutRequest

__all__ = ["NOT_BEFORE_KEY", "DelayedRequests", "hold_until", "not_before", "retry_delay_s", "with_not_before"]

log = logging.getLogger(__name__)

NOT_BEFORE_KEY = "fulmen.retry.not_before"
"""The request ``metadata`` key of a retry's not-before time (ISO 8601, UTC)."""

T = TypeVar("T")


def retry_delay_s(
    failed_attempt: int, base_s: float, cap_s: float, jitter: float, uniform: Callable[[], float] = random.random
) -> float:
    """Seconds to wait before the attempt after ``failed_attempt`` (1-based): ``min(cap, base * 2 ** (n - 1))``
    plus up to ``jitter`` of that (``uniform`` draws in [0, 1)). Never less than the exponential part."""
    if base_s <= 0:
        return 0.0
    delay = min(cap_s, base_s * 2.0 ** min(failed_attempt - 1, 64))
    return delay * (1.0 + jitter * uniform())


def with_not_before(request: RolloutRequest, when: datetime) -> RolloutRequest:
    """``request`` carrying ``when`` as its not-before time."""
    return request.model_copy(update={"metadata": {**request.metadata, NOT_BEFORE_KEY: when.isoformat()}})


def not_before(request: RolloutRequest) -> datetime | None:
    """The request's not-before time, or None (none given, or one that is not an ISO 8601 time: ignored)."""
    text = request.metadata.get(NOT_BEFORE_KEY)
    if not text:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        log.warning("rollout %s: %s=%r is not an ISO 8601 time; ignored", request.rollout_id, NOT_BEFORE_KEY, text)
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def hold_until(request: RolloutRequest, now: datetime, longest_s: float) -> datetime | None:
    """When a request taken at ``now`` may start, if that is later than ``now``: its not-before time, but no
    later than ``longest_s`` from ``now``. None: it may start now."""
    when = not_before(request)
    if when is None or when <= now:
        return None
    return min(when, now + timedelta(seconds=longest_s))


class DelayedRequests(Generic[T]):
    """Items held until a time (UTC), earliest first; ties keep the order they came in."""

    def __init__(self) -> None:
        self._heap: list[tuple[datetime, int, T]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, item: T, when: datetime) -> None:
        heapq.heappush(self._heap, (when, next(self._order), item))

    @property
    def next_at(self) -> datetime | None:
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: datetime, limit: int) -> list[T]:
        """Up to ``limit`` items whose time is ``now`` or earlier, earliest first."""
        due: list[T] = []
        while self._heap and len(due) < limit and self._heap[0][0] <= now:
            due.append(heapq.heappop(self._heap)[2])
        return due

    def drop(self, unwanted: Callable[[T], bool]) -> None:
        """Forget the items ``unwanted`` says yes to (the requests of partitions taken away)."""
        self._heap = [entry for entry in self._heap if not unwanted(entry[2])]
        heapq.heapify(self._heap)
