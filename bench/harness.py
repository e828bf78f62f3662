"""What every throughput bench shares: repetitions, their median and spread, and the load they ran under.

A bench measures one repetition as a dict of figures; :func:`summarise` turns the repetitions into the figures'
medians (the bench's headline keys), each figure's spread (``[min, max]``) and the load average before and after,
so a reader can tell a noisy machine from a real difference. Warm-up is the bench's own business (one repetition
run and thrown away, or a short burst): it says which in its docstring.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["load_average", "summarise"]


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages (2 cores: above 2 means something else competed)."""
    return [round(value, 2) for value in os.getloadavg()]


def summarise(
    runs: Sequence[dict[str, Any]], load_before: list[float], *, totals: Sequence[str] = ()
) -> dict[str, Any]:
    """Medians of the numeric figures of ``runs`` at the top level (sums for the keys in ``totals``: a span lost
    in one repetition is lost), with ``spread`` (min, max per figure), ``runs`` (each repetition as measured),
    ``repetitions`` and ``load_average`` (before, after)."""
    if not runs:
        raise ValueError("no repetitions to summarise")
    numeric = [key for key, value in runs[0].items() if isinstance(value, int | float) and not isinstance(value, bool)]
    summary: dict[str, Any] = {}
    spread: dict[str, list[float]] = {}
    for key in numeric:
        values = [run[key] for run in runs if isinstance(run.get(key), int | float)]
        summary[key] = sum(values) if key in totals else round(statistics.median(values), 4)
        spread[key] = [round(min(values), 4), round(max(values), 4)]
    summary["spread"] = spread
    summary["repetitions"] = len(runs)
    summary["runs"] = list(runs)
    summary["load_average"] = {"before": load_before, "after": load_average()}
    return summary
