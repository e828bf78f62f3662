"""Off-policy corrections: importance weights between the proximal and the behaviour policy (TIS, MIS, decoupled).

Three policies take part in a step (the names of Hilton et al. 2021, "Batch size-invariance for policy
optimization", which AReaL uses):

- behaviour ``mu``: the policy that sampled the tokens. The LLM gateway records its logprobs
  (``TrainBatch.behaviour_logprobs``); it may be several versions old, and computed by another engine (vLLM in
  bf16) than the trainer's;
- proximal ``pi_prox``: the weights at the start of the step. The trainer recomputes their logprobs before its
  first update (``TrainBatch.old_logprobs``); the policy losses clip ``pi_theta / pi_prox`` around it;
- ``pi_theta``: the weights being updated.

The samples come from ``mu``, the loss wants them from ``pi_prox``: a correction multiplies each token's
policy-gradient term by a DETACHED weight ``w`` made from ``log_ratio = proximal - behaviour`` ``[B, T]``. The
ratio ``rho`` is taken at a level (registry ``LEVELS``; log-ratios clamped to +-20 before ``exp``):

- ``token``: ``rho[b, t] = exp(log_ratio[b, t])``;
- ``sequence``: ``rho[b, t] = exp(sum_t' mask * log_ratio[b, t'])`` for every token of row b (the product).

The corrections (:class:`Correction`, one registry, ``fn(log_ratio, mask, *, level, low, high) -> (weights,
ImportanceStats)``):

- ``tis``: truncated importance sampling, ``w = min(rho, high)`` (Yao et al. 2025, "Your efficient RL framework
  secretly brings you off-policy RL training"; verl's ``rollout_is`` with a single threshold);
- ``mis``: masked importance sampling, ``w = rho if low <= rho <= high else 0`` (Liu et al. 2025, "When speed
  kills stability": sequence-level MIS; token level is IcePop; verl's ``rollout_is`` with ``"low_high"``);
- ``decoupled``: the decoupled objective, ``w = rho`` untruncated (Hilton et al. 2021; AReaL). The loss's clip is
  around ``pi_prox``, not ``mu``, so a sample several versions old still moves the policy a bounded amount
  from where the step started; its weight corrects for who sampled it. ``low`` and ``high`` are unused.

A token whose weight is 0 keeps counting in the loss normalizer (as verl's IcePop and AReaL's cap): masking
removes its gradient, not its share of the batch. Outside ``mask`` (prompt, padding, rows whose behaviour
logprobs were not recorded) the weight is exactly 1. Imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Protocol

import torch
from torch import Tensor

from fulmen.algorithm.rl.losses import LOG_RATIO_LIMIT
from fulmen.algorithm.rl.registry import Registry

__all__ = [
    "LEVELS",
    "Correction",
    "CorrectionFn",
    "CorrectionLevel",
    "ImportanceStats",
    "decoupled",
    "get_correction_fn",
    "get_level",
    "mis",
    "register_correction",
    "tis",
]


class Correction(StrEnum):
    """The built-in off-policy corrections."""

    TIS = "tis"
    MIS = "mis"
    DECOUPLED = "decoupled"


class CorrectionLevel(StrEnum):
    """Where the importance ratio is taken: per token, or one per sequence (the product of its tokens')."""

    TOKEN = "token"
    SEQUENCE = "sequence"


LevelFn = Callable[[Tensor, Tensor], Tensor]
"""``(log_ratio [B, T], keep [B, T] bool) -> log rho [B, T]`` (clamped to +-20)."""

LEVELS: Registry[LevelFn] = Registry("importance-ratio level")


@LEVELS.register(CorrectionLevel.TOKEN)
def _token_level(log_ratio: Tensor, keep: Tensor) -> Tensor:
    return log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


@LEVELS.register(CorrectionLevel.SEQUENCE)
def _sequence_level(log_ratio: Tensor, keep: Tensor) -> Tensor:
    total = log_ratio.masked_fill(~keep, 0.0).sum(dim=-1, keepdim=True)
    return total.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).expand_as(log_ratio)


def get_level(name: str) -> LevelFn:
    """The level registered as ``name``; ConfigurationError listing the valid names if there is none."""
    return LEVELS.get(name)


@dataclass(frozen=True)
class ImportanceStats:
    """Detached 0-d tensors over the tokens of ``mask`` (those with both logprobs known).

    ``weight_mean`` / ``weight_max``: of the weights applied (1 when no token is covered); ``ratio_max``: of the
    raw ratio ``rho`` before truncation or masking (how far apart the two policies got); ``truncated_fraction``:
    share of tokens whose weight was lowered but kept (``0 < w < rho``, tis); ``masked_fraction``: share whose
    weight was set to 0 (mis); ``tokens``: how many tokens these cover (weigh micro-batches by it).
    """

    weight_mean: Tensor
    weight_max: Tensor
    ratio_max: Tensor
    truncated_fraction: Tensor
    masked_fraction: Tensor
    tokens: Tensor

    @classmethod
    def of(cls, weights: Tensor, ratio: Tensor, keep: Tensor) -> ImportanceStats:
        """The statistics of ``weights`` made from ``ratio`` (both ``[B, T]``) over ``keep`` (bool ``[B, T]``)."""
        with torch.no_grad():
            tokens = keep.sum()
            count = tokens.clamp_min(1).to(weights.dtype)
            floor = torch.zeros((), dtype=weights.dtype, device=weights.device)
            return cls(
                weight_mean=torch.where(tokens > 0, weights.masked_fill(~keep, 0.0).sum() / count, floor + 1.0),
                weight_max=torch.where(tokens > 0, weights.masked_fill(~keep, 0.0).amax(), floor + 1.0),
                ratio_max=torch.where(tokens > 0, ratio.masked_fill(~keep, 0.0).amax(), floor + 1.0),
                truncated_fraction=((weights > 0) & (weights < ratio) & keep).sum() / count,
                masked_fraction=((weights == 0) & keep).sum() / count,
                tokens=tokens,
            )

    @classmethod
    def combine(cls, parts: Sequence[ImportanceStats]) -> ImportanceStats:
        """The statistics of the union of the parts (micro-batches): token-weighted means, maxima of maxima."""
        if not parts:
            raise ValueError("combine needs at least one part")
        tokens = torch.stack([p.tokens for p in parts]).sum()
        share = torch.stack([p.tokens for p in parts]).to(parts[0].weight_mean.dtype) / tokens.clamp_min(1)

        def mean(name: str) -> Tensor:
            return (torch.stack([getattr(p, name) for p in parts]) * share).sum()

        one = torch.ones((), dtype=share.dtype, device=share.device)
        return cls(
            weight_mean=torch.where(tokens > 0, mean("weight_mean"), one),
            weight_max=torch.stack([p.weight_max for p in parts]).amax(),
            ratio_max=torch.stack([p.ratio_max for p in parts]).amax(),
            truncated_fraction=mean("truncated_fraction"),
            masked_fraction=mean("masked_fraction"),
            tokens=tokens,
        )

    def as_floats(self) -> dict[str, float]:
        """The statistics as plain floats (one device sync)."""
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


class CorrectionFn(Protocol):
    """``(log_ratio [B, T], mask [B, T], *, level, low, high) -> (weights [B, T] detached, ImportanceStats)``."""

    def __call__(
        self, log_ratio: Tensor, mask: Tensor, *, level: str = ..., low: float = ..., high: float = ...
    ) -> tuple[Tensor, ImportanceStats]: ...


_CORRECTIONS: Registry[CorrectionFn] = Registry("off-policy correction")


def register_correction(name: str):  # -> Callable[[CorrectionFn], CorrectionFn]
    """Decorator registering a correction under ``name``; a name already taken raises ConfigurationError."""
    return _CORRECTIONS.register(name)


def get_correction_fn(name: str) -> CorrectionFn:
    """The correction registered as ``name``; ConfigurationError listing the valid names if there is none."""
    return _CORRECTIONS.get(name)


def _ratio(log_ratio: Tensor, mask: Tensor, level: str) -> tuple[Tensor, Tensor]:
    """``(rho [B, T], keep [B, T] bool)``, checking shapes; rho is 1 outside ``keep``."""
    if log_ratio.ndim != 2 or mask.shape != log_ratio.shape:
        raise ValueError(f"log_ratio and mask must both be [B, T]; got {list(log_ratio.shape)}, {list(mask.shape)}")
    keep = mask.bool()
    with torch.no_grad():
        rho = torch.exp(get_level(level)(log_ratio.detach(), keep)).masked_fill(~keep, 1.0)
    return rho, keep


def _check_bounds(low: float, high: float) -> None:
    if not 0.0 <= low <= high or high <= 0.0:
        raise ValueError(f"need 0 <= low <= high and high > 0; got low={low}, high={high}")


@register_correction(Correction.TIS)
def tis(
    log_ratio: Tensor, mask: Tensor, *, level: str = CorrectionLevel.TOKEN, low: float = 0.0, high: float = 2.0
) -> tuple[Tensor, ImportanceStats]:
    """Truncated importance sampling: ``w = min(rho, high)`` (``low`` unused); see the module docstring.

    ``log_ratio = proximal_logprobs - behaviour_logprobs`` and ``mask``: ``[B, T]``; weights ``[B, T]``, 1
    outside ``mask``. Biased (the truncated mass is lost) with bounded variance; ``high = 2`` as verl's default.
    """
    _check_bounds(low, high)
    rho, keep = _ratio(log_ratio, mask, level)
    weights = rho.clamp(max=high)
    return weights, ImportanceStats.of(weights, rho, keep)


@register_correction(Correction.MIS)
def mis(
    log_ratio: Tensor, mask: Tensor, *, level: str = CorrectionLevel.SEQUENCE, low: float = 0.0, high: float = 2.0
) -> tuple[Tensor, ImportanceStats]:
    """Masked importance sampling: ``w = rho`` where ``low <= rho <= high``, else 0; see the module docstring.

    At sequence level (the default, the paper's MIS) a sequence whose product ratio leaves the bounds gets no
    gradient at all; the others are weighted exactly. ``low = 0`` keeps every ratio below ``high``. Shapes as
    :func:`tis`.
    """
    _check_bounds(low, high)
    rho, keep = _ratio(log_ratio, mask, level)
    weights = torch.where((rho >= low) & (rho <= high), rho, torch.zeros_like(rho)).masked_fill(~keep, 1.0)
    return weights, ImportanceStats.of(weights, rho, keep)


@register_correction(Correction.DECOUPLED)
def decoupled(
    log_ratio: Tensor, mask: Tensor, *, level: str = CorrectionLevel.TOKEN, low: float = 0.0, high: float = 2.0
) -> tuple[Tensor, ImportanceStats]:
    """The decoupled objective's behaviour weight: ``w = rho = pi_prox / mu``, untruncated; ``low`` and ``high``
    are accepted for a uniform signature and unused (a bounded weight is ``tis`` or ``mis``).

    With the policy loss clipping ``pi_theta / pi_prox`` this is Hilton et al.'s decoupled PPO::

        loss = -E_mu[ (pi_prox / mu) * min(r A, clip(r, 1 - eps, 1 + eps_high) A) ],  r = pi_theta / pi_prox

    Shapes as :func:`tis`; token level by default (Hilton et al., AReaL).
    """
    del low, high
    rho, keep = _ratio(log_ratio, mask, level)
    return rho, ImportanceStats.of(rho, rho, keep)
