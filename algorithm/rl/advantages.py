"""Group-relative advantage estimators (GRPO, Dr. GRPO, RLOO): one scalar reward per sample -> one advantage.

Every estimator has the signature ``fn(rewards, group_ids, eps=1e-6) -> advantages``:

- ``rewards``: float tensor ``[N]``, one reward per sample (after credit assignment);
- ``group_ids``: integer tensor ``[N]``; samples with equal ids were answers to the same prompt (a GRPO group).
  Ids need not be contiguous or sorted (:func:`encode_group_ids` turns any hashable keys into such a tensor);
- returns ``[N]`` in the dtype of ``rewards``, computed in at least float32.

All group statistics are computed with scatter ops (``index_add_``), never a Python loop over groups. A group of
one sample gets advantage 0 under every estimator (it has no baseline to compare with). Imports only torch.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from enum import StrEnum
from typing import Protocol

import torch
from torch import Tensor

from fulmen.algorithm.rl.registry import Registry

__all__ = [
    "AdvantageEstimator",
    "AdvantageFn",
    "compute_advantages",
    "dr_grpo",
    "encode_group_ids",
    "get_advantage_fn",
    "grpo",
    "register_advantage",
    "rloo",
]


class AdvantageEstimator(StrEnum):
    """The built-in estimators (the registry accepts more names via :func:`register_advantage`)."""

    GRPO = "grpo"
    DR_GRPO = "dr_grpo"
    RLOO = "rloo"


class AdvantageFn(Protocol):
    """``(rewards [N] float, group_ids [N] long, eps) -> advantages [N]``."""

    def __call__(self, rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor: ...


_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


def register_advantage(name: str):  # -> Callable[[AdvantageFn], AdvantageFn]
    """Decorator registering an estimator under ``name``; a name already taken raises ConfigurationError."""
    return _ESTIMATORS.register(name)


def get_advantage_fn(name: str) -> AdvantageFn:
    """The estimator registered as ``name``; ConfigurationError listing the valid names if there is none."""
    return _ESTIMATORS.get(name)


def compute_advantages(name: str, rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """Shorthand for ``get_advantage_fn(name)(rewards, group_ids, eps)``."""
    return get_advantage_fn(name)(rewards, group_ids, eps)


def encode_group_ids(keys: Iterable[Hashable]) -> Tensor:
    """Dense long ids ``[N]`` for any hashable group keys (e.g. the ``group_id`` strings of transitions)."""
    index: dict[Hashable, int] = {}
    return torch.tensor([index.setdefault(key, len(index)) for key in keys], dtype=torch.long)


class _Groups:
    """The group structure of one batch: ``inverse[i]`` is sample i's group, ``count[g]`` the size of group g."""

    def __init__(self, rewards: Tensor, group_ids: Tensor) -> None:
        if rewards.ndim != 1 or group_ids.shape != rewards.shape:
            raise ValueError(
                f"rewards and group_ids must both be [N]; got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
            )
        if not rewards.is_floating_point() or group_ids.is_floating_point() or group_ids.is_complex():
            raise ValueError(f"rewards must be float and group_ids integer; got {rewards.dtype}, {group_ids.dtype}")
        unique, self.inverse = torch.unique(group_ids, return_inverse=True)
        self.num_groups = unique.numel()
        self.count = self.sum(torch.ones_like(rewards, dtype=_work_dtype(rewards)))

    def sum(self, values: Tensor) -> Tensor:
        """Per-group sums ``[G]`` of per-sample ``values [N]``."""
        return values.new_zeros(self.num_groups).index_add_(0, self.inverse, values)

    def per_sample(self, per_group: Tensor) -> Tensor:
        """Broadcast a per-group tensor ``[G]`` back to the samples ``[N]``."""
        return per_group[self.inverse]


def _work_dtype(rewards: Tensor) -> torch.dtype:
    return torch.float64 if rewards.dtype == torch.float64 else torch.float32


def _deviation(rewards: Tensor, groups: _Groups) -> Tensor:
    """``r_i - mean_g`` per sample, in the work dtype (exactly 0 for a group of one)."""
    r = rewards.to(_work_dtype(rewards))
    mean = groups.sum(r) / groups.count
    return r - groups.per_sample(mean)


@register_advantage(AdvantageEstimator.GRPO)
def grpo(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO: ``A_i = (r_i - mean_g) / (std_g + eps)``.

    ``std_g`` is the UNBIASED (Bessel-corrected, ``n - 1``) standard deviation, as ``torch.std`` computes it
    and as verl's ``compute_grpo_outcome_advantage`` uses. A group whose rewards are all equal gets 0; so does
    a group of one sample (verl instead gives a lone sample ``r / (1 + eps)``: mean 0, std 1).
    """
    groups = _Groups(rewards, group_ids)
    deviation = _deviation(rewards, groups)
    variance = groups.sum(deviation * deviation) / (groups.count - 1).clamp_min(1)
    std = groups.per_sample(variance.sqrt())
    return (deviation / (std + eps)).to(rewards.dtype)


@register_advantage(AdvantageEstimator.DR_GRPO)
def dr_grpo(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): ``A_i = r_i - mean_g``, no std.

    ``eps`` is accepted for a uniform signature and unused. Equals verl's GRPO with
    ``norm_adv_by_std_in_grpo=False`` for groups of two or more.
    """
    del eps
    groups = _Groups(rewards, group_ids)
    return _deviation(rewards, groups).to(rewards.dtype)


@register_advantage(AdvantageEstimator.RLOO)
def rloo(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """RLOO (Ahmadian et al. 2024): ``A_i = r_i - mean(r_j for j != i in the group)``, 0 for a group of one.

    Computed as ``n / (n - 1) * (r_i - mean_g)``, the same value verl's ``compute_rloo_outcome_advantage``
    returns for groups of two or more (verl leaves a lone sample's advantage at ``r``). ``eps`` is unused.
    """
    del eps
    groups = _Groups(rewards, group_ids)
    count = groups.per_sample(groups.count)
    scale = torch.where(count > 1, count / (count - 1).clamp_min(1), torch.zeros_like(count))
    return (_deviation(rewards, groups) * scale).to(rewards.dtype)
