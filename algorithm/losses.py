"""Policy losses (PPO-clip) and the one reduction of per-token losses to a scalar (:func:`aggregate`).

Shapes: ``B`` sequences, ``T`` token positions. Per-token tensors are ``[B, T]`` aligned to the input tokens
(position t holds the value for token t); ``mask [B, T]`` is 1 on the tokens that carry loss (the response
tokens) and 0 elsewhere; ``advantages`` are ``[B]`` (one per sequence, broadcast over its tokens).

Reduction (:class:`LossAggregation`), always ``sum(...) / normalizer``:

- ``token_mean``: ``sum_{b,t} mask * x / normalizer``; default normalizer = masked tokens in the batch;
- ``seq_mean``: ``sum_b (sum_t mask * x / tokens_b) / normalizer``; default normalizer = sequences with at
  least one masked token (fully masked rows add 0). verl calls this ``seq-mean-token-mean``.

Gradient accumulation: pass the WHOLE batch's normalizer (:func:`batch_normalizer`) when reducing each
micro-batch; the micro-batch losses then sum exactly to the full-batch loss. Imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Protocol

import torch
from torch import Tensor

from fulmen.algorithm.registry import Registry

__all__ = [
    "Aggregation",
    "LossAggregation",
    "PolicyLoss",
    "PolicyLossFn",
    "PolicyLossMetrics",
    "aggregate",
    "batch_normalizer",
    "get_aggregation",
    "get_policy_loss_fn",
    "k3_kl",
    "masked_mean",
    "ppo_clip",
    "register_aggregation",
    "register_policy_loss",
]

LOG_RATIO_LIMIT = 20.0  # log-ratios are clamped to +-20 before exp (as verl does): no inf from one wild token
K3_LIMIT = 10.0  # the k3 KL estimate per token is clamped to +-10 (as verl's low_var_kl)


class PolicyLoss(StrEnum):
    """The built-in policy losses."""

    PPO_CLIP = "ppo_clip"


class LossAggregation(StrEnum):
    """The built-in reductions of per-token losses (see the module docstring)."""

    TOKEN_MEAN = "token_mean"
    SEQ_MEAN = "seq_mean"


@dataclass(frozen=True)
class Aggregation:
    """A reduction: ``total(per_token, keep)`` is the 0-d numerator, ``count(keep)`` the default normalizer.

    ``keep`` is the mask as a bool ``[B, T]``.
    """

    total: Callable[[Tensor, Tensor], Tensor]
    count: Callable[[Tensor], Tensor]


_AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation")


def register_aggregation(name: str, aggregation: Aggregation) -> Aggregation:
    """Register a reduction under ``name``; a name already taken raises ConfigurationError."""
    return _AGGREGATIONS.register(name)(aggregation)


def get_aggregation(name: str) -> Aggregation:
    """The reduction registered as ``name``; ConfigurationError listing the valid names if there is none."""
    return _AGGREGATIONS.get(name)


def _token_total(per_token: Tensor, keep: Tensor) -> Tensor:
    return per_token.masked_fill(~keep, 0.0).sum()


def _seq_total(per_token: Tensor, keep: Tensor) -> Tensor:
    lengths = keep.sum(dim=-1).clamp_min(1).to(per_token.dtype)
    return (per_token.masked_fill(~keep, 0.0).sum(dim=-1) / lengths).sum()


register_aggregation(LossAggregation.TOKEN_MEAN, Aggregation(total=_token_total, count=lambda keep: keep.sum()))
register_aggregation(LossAggregation.SEQ_MEAN, Aggregation(total=_seq_total, count=lambda keep: keep.any(dim=-1).sum()))


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str = LossAggregation.TOKEN_MEAN,
    normalizer: float | Tensor | None = None,
) -> Tensor:
    """Reduce ``per_token [B, T]`` over ``mask [B, T]`` to a 0-d tensor: ``total / normalizer``.

    ``normalizer`` defaults to this batch's own count (masked tokens for token_mean, non-empty sequences for
    seq_mean); give the whole batch's :func:`batch_normalizer` to reduce a micro-batch relative to the whole
    batch. A normalizer below 1 is taken as 1, so an all-masked batch reduces to 0 rather than NaN.
    """
    if per_token.shape != mask.shape or per_token.ndim != 2:
        raise ValueError(f"per_token and mask must both be [B, T]; got {tuple(per_token.shape)}, {tuple(mask.shape)}")
    aggregation = get_aggregation(mode)
    keep = mask.bool()
    denominator = aggregation.count(keep) if normalizer is None else normalizer
    denominator = torch.as_tensor(denominator, dtype=per_token.dtype, device=per_token.device).clamp_min(1.0)
    return aggregation.total(per_token, keep) / denominator


def batch_normalizer(mask: Tensor, mode: str = LossAggregation.TOKEN_MEAN) -> float:
    """The normalizer :func:`aggregate` uses by default for the whole batch ``mask [B, T]``, as a float."""
    return float(get_aggregation(mode).count(mask.bool()))


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values [B, T]`` over the tokens where ``mask`` is set (0 when none is)."""
    keep = mask.bool()
    return values.masked_fill(~keep, 0.0).sum() / keep.sum().clamp_min(1)


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || ref) (Schulman, "Approximating KL divergence", 2020).

    ``k3 = exp(d) - d - 1`` with ``d = ref_logprobs - logprobs`` (clamped to +-20), itself clamped to
    +-10 as verl's ``low_var_kl`` does. Non-negative, unbiased for samples drawn from the policy.
    """
    d = (ref_logprobs - logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return (torch.exp(d) - d - 1.0).clamp(-K3_LIMIT, K3_LIMIT)


@dataclass(frozen=True)
class PolicyLossMetrics:
    """Detached 0-d tensors, each a mean over the masked tokens of the batch the loss was computed on.

    ``clip_fraction``: share of tokens whose clipped term was the active one (no gradient through them);
    ``approx_kl``: k1 estimate of KL(old || new), ``mean(old_logprobs - logprobs)`` (verl's ``ppo_kl``);
    ``ref_kl``: k3 estimate of KL(policy || ref) (:func:`k3_kl`), 0 without ``ref_logprobs``;
    ``ratio_mean``: mean of ``exp(logprobs - old_logprobs)``; ``tokens``: how many tokens the means cover
    (weigh micro-batch metrics by it to combine them).
    """

    clip_fraction: Tensor
    approx_kl: Tensor
    ref_kl: Tensor
    ratio_mean: Tensor
    tokens: Tensor

    def as_floats(self) -> dict[str, float]:
        """The metrics as plain floats (one device sync)."""
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


class PolicyLossFn(Protocol):
    """``(logprobs, old_logprobs, advantages, mask, **options) -> (loss 0-d, metrics)``; see :func:`ppo_clip`."""

    def __call__(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, **options: object
    ) -> tuple[Tensor, PolicyLossMetrics]: ...


_POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def register_policy_loss(name: str):  # -> Callable[[PolicyLossFn], PolicyLossFn]
    """Decorator registering a policy loss under ``name``; a name already taken raises ConfigurationError."""
    return _POLICY_LOSSES.register(name)


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name``; ConfigurationError listing the valid names if there is none."""
    return _POLICY_LOSSES.get(name)


def _check_shapes(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> None:
    if logprobs.ndim != 2 or old_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs, old_logprobs and mask must be the same [B, T]; got {tuple(logprobs.shape)}, "
            f"{tuple(old_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B] = [{logprobs.shape[0]}]; got {tuple(advantages.shape)}")


@register_policy_loss(PolicyLoss.PPO_CLIP)
def ppo_clip(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    aggregation: str = LossAggregation.TOKEN_MEAN,
    normalizer: float | Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[Tensor, PolicyLossMetrics]:
    """PPO's clipped surrogate (Schulman et al. 2017), per token, plus an optional KL penalty to a reference.

    ``ratio = exp(logprobs - old_logprobs)`` (log-ratio clamped to +-20), ``A = advantages[:, None]``::

        per_token = max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps_high))
        loss      = aggregate(per_token, mask, aggregation, normalizer)
                    + kl_coef * aggregate(k3_kl(logprobs, ref_logprobs), mask, aggregation, normalizer)

    ``clip_eps_high`` defaults to ``clip_eps`` (set it higher for DAPO's "clip-higher"). No dual clip: the
    loss of a negative-advantage token is not bounded at ``ratio = 3`` as verl's vanilla loss bounds it.
    ``logprobs``, ``old_logprobs``, ``ref_logprobs``, ``mask``: ``[B, T]``; ``advantages``: ``[B]``.
    Only ``logprobs`` should carry gradient. Returns ``(loss 0-d, PolicyLossMetrics)``.
    """
    _check_shapes(logprobs, old_logprobs, advantages, mask)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    if not 0.0 < clip_eps < 1.0 or high <= 0.0:
        raise ValueError(f"need 0 < clip_eps < 1 and clip_eps_high > 0; got {clip_eps}, {clip_eps_high}")
    if kl_coef and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the reference model's token logprobs)")
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    advantage = advantages.to(logprobs.dtype)[:, None]
    unclipped = -advantage * ratio
    clipped = -advantage * ratio.clamp(1.0 - clip_eps, 1.0 + high)
    loss = aggregate(torch.maximum(unclipped, clipped), mask, aggregation, normalizer)
    ref_kl = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    if ref_logprobs is not None:
        per_token_kl = k3_kl(logprobs, ref_logprobs)
        if kl_coef:
            loss = loss + kl_coef * aggregate(per_token_kl, mask, aggregation, normalizer)
        ref_kl = masked_mean(per_token_kl.detach(), mask)
    with torch.no_grad():
        metrics = PolicyLossMetrics(
            clip_fraction=masked_mean((clipped > unclipped).to(logprobs.dtype), mask),
            approx_kl=masked_mean(-log_ratio, mask),
            ref_kl=ref_kl,
            ratio_mean=masked_mean(ratio, mask),
            tokens=mask.bool().sum(),
        )
    return loss, metrics
