"""Late spans: find the built rollouts that received a span after their transitions were built.

Every ``interval_s`` the check asks the store two things (blocking: run it in a worker thread):

1. which watched rollout attempts received spans since the previous check (``IngestedAt``, the store's own
   clock, minus a slack for inserts that became visible after their ``IngestedAt`` was taken);
2. for those still watched (built, within their late window), how many distinct spans they have now.

A watched rollout with more spans than it was built from is late: the worker rebuilds it. A span that arrives
after the rollout's late window (``late_window_s`` after the build) is not looked for: it stays in
``otel_traces``, and ``SELECT ... FROM otel_traces WHERE IngestedAt > <the batch's created_at>`` finds it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Protocol

from fulmen.consumers.transitions.reader import RolloutKey, SpanReader

__all__ = ["SLACK_MS", "LateSpanCheck"]

SLACK_MS = 5_000  # an insert may become visible this long after its IngestedAt was taken


class _Watched(Protocol):
    span_count: int


class LateSpanCheck:
    """When to look (:meth:`due`) and what is late (:meth:`late`)."""

    def __init__(
        self, reader: SpanReader, window_s: float, interval_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if window_s < 0 or interval_s <= 0:
            raise ValueError("window_s must be >= 0 and interval_s > 0")
        self.reader = reader
        self.window_s = window_s
        self.interval_s = interval_s
        self.clock = clock
        self._since_ms: int | None = None
        self._next = 0.0

    def due(self) -> bool:
        """Whether a check is due now (never when the window is 0); moves the next one ``interval_s`` on."""
        if self.window_s == 0 or self.clock() < self._next:
            return False
        self._next = self.clock() + self.interval_s
        return True

    def late(self, watched: Mapping[RolloutKey, _Watched]) -> dict[RolloutKey, int]:
        """The watched rollouts that have more spans now than they were built from: key -> spans now."""
        now_ms = self.reader.now_ms()
        since = self._since_ms if self._since_ms is not None else now_ms - int(self.window_s * 1000)
        if not watched:
            self._since_ms = now_ms
            return {}
        recent = self.reader.recently_ingested({rollout for rollout, _ in watched}, since - SLACK_MS)
        candidates = [key for key in recent if key in watched]
        counts = self.reader.span_counts(candidates) if candidates else {}
        self._since_ms = now_ms  # only once the queries succeeded: a failed check is redone from the same point
        return {key: count for key, count in counts.items() if count > watched[key].span_count}
