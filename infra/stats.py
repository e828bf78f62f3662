"""The one interval Fulmen draws around a gain: the normal-approximation interval of a mean of per-task differences.

Two versions validated on the same tasks give, per task, the difference of their outcomes (1 solved, 0 not; a
share when a task ran several times). The promotion gate (:mod:`fulmen.algorithm.service.promotion`) promotes a
candidate only when the whole interval of the mean difference lies above its margin, so a tie, or a gain smaller
than the noise of which tasks were drawn, is refused; the learning benches (``bench/scenario_stats.py``) report the
same interval. With every difference equal (all ties, say) the interval is that one point.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

__all__ = ["PairedGain", "mean_interval", "paired_gain"]


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean of ``values`` and its two-sided normal-approximation interval at
    ``confidence``."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1, not {confidence}")
    n = len(values)
    if n == 0:
        raise ValueError("an interval needs at least one value")
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    half = NormalDist().inv_cdf(0.5 + confidence / 2) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


@dataclass(frozen=True)
class PairedGain:
    """The candidate's gain over the baseline on the tasks both were validated on."""

    n: int
    gain: float
    low: float
    high: float
    confidence: float

    def above(self, margin: float) -> bool:
        """The whole interval lies above ``margin``: the gain is real at this confidence."""
        return self.n > 0 and self.low > margin

    def describe(self) -> str:
        return (
            f"gain {100 * self.gain:+.1f} points on {self.n} held-out tasks, "
            f"{100 * self.confidence:g}% interval [{100 * self.low:+.1f}, {100 * self.high:+.1f}]"
        )


def paired_gain(candidate: Mapping[str, float], baseline: Mapping[str, float], confidence: float = 0.95) -> PairedGain:
    """Per task both have an outcome for (by task id): candidate minus baseline; their mean and its interval. No task
    in common: n = 0 and a gain of 0 (which passes no margin)."""
    common = sorted(candidate.keys() & baseline.keys())
    if not common:
        return PairedGain(0, 0.0, 0.0, 0.0, confidence)
    mean, low, high = mean_interval([candidate[t] - baseline[t] for t in common], confidence)
    return PairedGain(len(common), mean, max(-1.0, low), min(1.0, high), confidence)
