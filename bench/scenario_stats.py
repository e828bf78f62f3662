"""The learning protocol's arithmetic: per-task outcomes of several runs -> means, per-seed gains, pooled intervals,
breakdowns by template and failure kind (what ``bench/scenarios.py`` reports).

A run's outcomes (``examples.outcomes``): per split (``heldout``, ``unseen``), the tasks in order and, per model
version validated, whether each was solved and its failure kind. "Before" is the first version validated, "after"
the last. The pooled interval of a gain over seeds: per task, the mean over seeds of (after - before); then the
normal-approximation 95% interval of the mean of those per-task means (``fulmen.infra.stats``, the promotion gate's; it
covers which problems were drawn, with the training runs' variation averaged in); ``seed_ci95`` is the t interval
of the per-seed gains (how much training runs vary). Every interval is clipped to what a difference of shares can
be ([-1, 1]), and an accuracy's to [0, 1].
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

from fulmen.infra.stats import mean_interval

__all__ = [
    "accuracy",
    "before_after",
    "by_template",
    "failure_counts",
    "pooled_gain",
    "ratio_interval",
    "seed_interval",
    "t95",
]

Z95 = 1.959964
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom (normal past 9)."""
    return _T95.get(df, Z95)


def _versions(split: dict[str, Any]) -> list[str]:
    return sorted(split["by_version"], key=int)


def before_after(split: dict[str, Any]) -> tuple[list[bool], list[bool]] | None:
    """The first and the last validated version's solved flags; None with fewer than two versions."""
    versions = _versions(split)
    if len(versions) < 2:
        return None
    return split["by_version"][versions[0]]["solved"], split["by_version"][versions[-1]]["solved"]


def accuracy(solved: Sequence[bool]) -> float | None:
    return round(sum(solved) / len(solved), 4) if solved else None


def _clip(low: float, high: float, bound: float) -> list[float]:
    return [round(max(-bound, low), 4), round(min(bound, high), 4)]


def pooled_gain(runs: Sequence[tuple[Sequence[bool], Sequence[bool]]]) -> dict[str, Any]:
    """Mean gain over runs (each a (before, after) pair on the same tasks) and its pooled 95% interval."""
    if not runs:
        return {}
    n = len(runs[0][0])
    if any(len(b) != n or len(a) != n for b, a in runs):
        raise ValueError("every run must validate the same tasks")
    per_task = [sum(float(a[i]) - float(b[i]) for b, a in runs) / len(runs) for i in range(n)]
    mean, low, high = mean_interval(per_task, 0.95)  # the promotion gate's interval (fulmen.infra.stats)
    return {"gain": round(mean, 4), "ci95": _clip(low, high, 1.0), "n": n}


def seed_interval(gains: Sequence[float]) -> list[float] | None:
    """The t interval of the mean of per-seed gains (None for fewer than two seeds)."""
    if len(gains) < 2:
        return None
    mean = sum(gains) / len(gains)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gains) / (len(gains) - 1))
    half = t95(len(gains) - 1) * sd / math.sqrt(len(gains))
    return _clip(mean - half, mean + half, 1.0)


def by_template(templates: Sequence[str], runs: Sequence[tuple[Sequence[bool], Sequence[bool]]]) -> dict[str, Any]:
    """Per template: tasks, and accuracy before and after, averaged over runs."""
    table: dict[str, Any] = {}
    for name in sorted(set(templates)):
        picked = [i for i, t in enumerate(templates) if t == name]
        before = sum(sum(b[i] for i in picked) for b, _ in runs) / (len(picked) * len(runs))
        after = sum(sum(a[i] for i in picked) for _, a in runs) / (len(picked) * len(runs))
        table[name] = {"n": len(picked), "before": round(before, 4), "after": round(after, 4)}
    return table


def failure_counts(kinds_by_run: Sequence[Sequence[str]]) -> dict[str, float]:
    """Mean count per run of each failure kind (``correct`` included), largest first."""
    total: Counter[str] = Counter()
    for kinds in kinds_by_run:
        total.update(kinds)
    runs = max(len(kinds_by_run), 1)
    return {kind: round(count / runs, 2) for kind, count in total.most_common()}


def ratio_interval(
    numerator: Sequence[tuple[Sequence[bool], Sequence[bool]]],
    denominator: Sequence[tuple[Sequence[bool], Sequence[bool]]],
    resamples: int = 5000,
    seed: int = 0,
) -> dict[str, Any]:
    """The ratio of two pooled gains on the same tasks (replay's over on-policy's) and its 95% interval: a paired
    bootstrap over the tasks (each resample draws the same tasks for both), percentiles of the ratio; the interval is
    None when a resample's denominator is not above zero."""
    if not numerator or not denominator:
        return {}
    top, bottom = _per_task_gain(numerator), _per_task_gain(denominator)
    if len(top) != len(bottom):
        raise ValueError("both gains must be on the same tasks")
    if sum(bottom) <= 0:
        return {"ratio": None, "ci95": None}
    rng = random.Random(seed)
    n = len(top)
    ratios = []
    for _ in range(resamples):
        drawn = [rng.randrange(n) for _ in range(n)]
        below = sum(bottom[i] for i in drawn)
        if below <= 0:
            return {"ratio": round(sum(top) / sum(bottom), 4), "ci95": None}
        ratios.append(sum(top[i] for i in drawn) / below)
    ratios.sort()
    low, high = ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]
    return {"ratio": round(sum(top) / sum(bottom), 4), "ci95": [round(low, 4), round(high, 4)]}


def _per_task_gain(runs: Sequence[tuple[Sequence[bool], Sequence[bool]]]) -> list[float]:
    n = len(runs[0][0])
    return [sum(float(a[i]) - float(b[i]) for b, a in runs) / len(runs) for i in range(n)]
