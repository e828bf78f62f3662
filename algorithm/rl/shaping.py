"""Reward shaping applied before the advantages: DAPO's soft overlong punishment (:func:`overlong_penalty`).

A response cut off at the length limit is usually wrong for a reason the reward does not name (it never
finished); punishing only those at the limit is a cliff. DAPO (Yu et al. 2025, section 3.4) ramps a penalty
over the last ``buffer_tokens`` before the limit ``max_tokens``::

    p(L) = -penalty * clamp((L - (max_tokens - buffer_tokens)) / buffer_tokens, 0, 1)

``0`` up to ``max_tokens - buffer_tokens`` tokens, falling linearly to ``-penalty`` at ``max_tokens``, and
``-penalty`` beyond (the paper's -1 for ``L > L_max``). Up to ``max_tokens`` this is verl's
``DAPORewardManager`` penalty. :class:`OverlongShaping` holds the three settings; where the penalty is added
(each call's own penalty, summed over a rollout's calls for the episode scope) is ``fulmen.algorithm.service.samples``.
Imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["OverlongShaping", "overlong_penalty"]


@dataclass(frozen=True)
class OverlongShaping:
    """The soft overlong punishment's settings: the response limit, the ramp before it, the full penalty."""

    max_tokens: int
    buffer_tokens: int
    penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or not 0 < self.buffer_tokens <= self.max_tokens or self.penalty < 0:
            raise ValueError(
                "overlong shaping needs max_tokens >= 1, 0 < buffer_tokens <= max_tokens and penalty >= 0; got "
                f"max_tokens={self.max_tokens}, buffer_tokens={self.buffer_tokens}, penalty={self.penalty}"
            )

    def __call__(self, lengths: Tensor) -> Tensor:
        """:func:`overlong_penalty` of ``lengths`` with these settings."""
        return overlong_penalty(lengths, self.max_tokens, self.buffer_tokens, self.penalty)


def overlong_penalty(lengths: Tensor, max_tokens: int, buffer_tokens: int, penalty: float = 1.0) -> Tensor:
    """The penalty ``p(L) <= 0`` of the module docstring for response ``lengths [N]`` (tokens); float ``[N]``."""
    expected = max_tokens - buffer_tokens
    excess = (lengths.to(torch.float64) - expected) / buffer_tokens
    return -penalty * excess.clamp(0.0, 1.0)
