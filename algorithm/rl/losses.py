"""Policy losses (PPO-clip, DAPO, GSPO, CISPO) and the one reduction of per-token losses (:func:`aggregate`).

Shapes: ``B`` sequences, ``T`` token positions. Per-token tensors are ``[B, T]`` aligned to the input tokens
(position t holds the value for token t); ``mask [B, T]`` is 1 on the tokens that carry loss (the response
tokens) and 0 elsewhere; ``advantages`` are ``[B]`` (one per sequence, broadcast over its tokens).

Every loss has the signature of :class:`PolicyLossFn` and the same options: the clip range (``clip_eps`` below 1,
``clip_eps_high`` above), the reduction (``aggregation``, ``normalizer``), optional off-policy ``weights [B, T]``
(detached importance weights from :mod:`fulmen.algorithm.rl.corrections`, multiplying the per-token policy-gradient
term) and an optional k3 KL penalty to a reference (``ref_logprobs``, ``kl_coef``). Each returns
``(loss 0-d, PolicyLossMetrics)``.

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
from typing import Protocol, TypedDict, Unpack

import torch
from torch import Tensor

from fulmen.algorithm.rl.registry import Registry

__all__ = [
    "Aggregation",
    "CommonOptions",
    "LossAggregation",
    "PolicyLoss",
    "PolicyLossFn",
    "PolicyLossMetrics",
    "aggregate",
    "batch_normalizer",
    "cispo",
    "dapo",
    "get_aggregation",
    "get_policy_loss_fn",
    "gspo",
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
    DAPO = "dapo"
    GSPO = "gspo"
    CISPO = "cispo"


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

    ``clip_fraction``: share of tokens the clip acted on (PPO, DAPO, GSPO: the clipped term was the active one,
    no gradient through them; CISPO: the weight was clipped, the gradient stays); ``approx_kl``: k1 estimate
    of KL(old || new), ``mean(old_logprobs - logprobs)`` (verl's ``ppo_kl``); ``ref_kl``: k3 estimate of
    KL(policy || ref) (:func:`k3_kl`), 0 without ``ref_logprobs``; ``ratio_mean``: mean importance ratio the
    loss used (per token; GSPO: each token carries its sequence's ratio); ``tokens``: how many tokens the
    means cover (weigh micro-batch metrics by it to combine them).
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
    """``(logprobs, old_logprobs, advantages, mask, **options) -> (loss 0-d, metrics)``; options in the module
    docstring, see :func:`ppo_clip`."""

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


class CommonOptions(TypedDict, total=False):
    """The options every loss takes besides its clip range and aggregation (see the module docstring).

    ``normalizer``: of :func:`aggregate` (the whole batch's, for micro-batches); ``weights [B, T]``: detached
    off-policy importance weights on the per-token policy-gradient term; ``ref_logprobs [B, T]`` and
    ``kl_coef``: the k3 KL penalty to a reference policy."""

    normalizer: float | Tensor | None
    weights: Tensor | None
    ref_logprobs: Tensor | None
    kl_coef: float


def _check_inputs(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, common: CommonOptions
) -> None:
    weights, ref_logprobs = common.get("weights"), common.get("ref_logprobs")
    if logprobs.ndim != 2 or old_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs, old_logprobs and mask must be the same [B, T]; got {tuple(logprobs.shape)}, "
            f"{tuple(old_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B] = [{logprobs.shape[0]}]; got {tuple(advantages.shape)}")
    if weights is not None and weights.shape != logprobs.shape:
        raise ValueError(f"weights must be [B, T] = {list(logprobs.shape)}; got {list(weights.shape)}")
    if common.get("kl_coef") and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the reference model's token logprobs)")


def _clip_range(clip_eps: float, clip_eps_high: float | None) -> tuple[float, float]:
    """``(1 - clip_eps, 1 + clip_eps_high)``; ``clip_eps_high`` defaults to ``clip_eps``."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    if not 0.0 < clip_eps <= 1.0 or high <= 0.0:
        raise ValueError(f"need 0 < clip_eps <= 1 and clip_eps_high > 0; got {clip_eps}, {clip_eps_high}")
    return 1.0 - clip_eps, 1.0 + high


def _finish(
    per_token: Tensor,
    logprobs: Tensor,
    log_ratio: Tensor,
    ratio: Tensor,
    clipped: Tensor,
    mask: Tensor,
    *,
    aggregation: str,
    normalizer: float | Tensor | None = None,
    weights: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[Tensor, PolicyLossMetrics]:
    """``aggregate(weights * per_token) + kl_coef * aggregate(k3_kl)`` and the metrics, shared by every loss."""
    if weights is not None:
        per_token = per_token * weights.detach().to(per_token.dtype)
    loss = aggregate(per_token, mask, aggregation, normalizer)
    ref_kl = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    if ref_logprobs is not None:
        per_token_kl = k3_kl(logprobs, ref_logprobs)
        if kl_coef:
            loss = loss + kl_coef * aggregate(per_token_kl, mask, aggregation, normalizer)
        ref_kl = masked_mean(per_token_kl.detach(), mask)
    with torch.no_grad():
        metrics = PolicyLossMetrics(
            clip_fraction=masked_mean(clipped.to(logprobs.dtype), mask),
            approx_kl=masked_mean(-log_ratio.detach(), mask),
            ref_kl=ref_kl,
            ratio_mean=masked_mean(ratio.detach(), mask),
            tokens=mask.bool().sum(),
        )
    return loss, metrics


def _clipped_surrogate(
    ratio: Tensor,
    log_ratio: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    bounds: tuple[float, float],
    aggregation: str,
    common: CommonOptions,
) -> tuple[Tensor, PolicyLossMetrics]:
    """``max(-A * ratio, -A * clip(ratio, *bounds))`` per token, reduced by :func:`_finish` (PPO, DAPO, GSPO)."""
    advantage = advantages.to(logprobs.dtype)[:, None]
    unclipped = -advantage * ratio
    clipped = -advantage * ratio.clamp(*bounds)
    return _finish(
        torch.maximum(unclipped, clipped),
        logprobs,
        log_ratio,
        ratio,
        clipped > unclipped,
        mask,
        aggregation=aggregation,
        **common,
    )


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
    **common: Unpack[CommonOptions],
) -> tuple[Tensor, PolicyLossMetrics]:
    """PPO's clipped surrogate (Schulman et al. 2017), per token, plus an optional KL penalty to a reference.

    ``ratio = exp(logprobs - old_logprobs)`` (log-ratio clamped to +-20), ``A = advantages[:, None]``,
    ``w = weights`` (1 when None)::

        per_token = w * max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps_high))
        loss      = aggregate(per_token, mask, aggregation, normalizer)
                    + kl_coef * aggregate(k3_kl(logprobs, ref_logprobs), mask, aggregation, normalizer)

    ``clip_eps_high`` defaults to ``clip_eps`` (set it higher for DAPO's "clip-higher"). No dual clip: the
    loss of a negative-advantage token is not bounded at ``ratio = 3`` as verl's vanilla loss bounds it.
    ``logprobs``, ``old_logprobs``, ``ref_logprobs``, ``weights``, ``mask``: ``[B, T]``; ``advantages``: ``[B]``.
    Only ``logprobs`` should carry gradient. Returns ``(loss 0-d, PolicyLossMetrics)``.
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask, common)
    bounds = _clip_range(clip_eps, clip_eps_high)
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return _clipped_surrogate(torch.exp(log_ratio), log_ratio, logprobs, advantages, mask, bounds, aggregation, common)


@register_policy_loss(PolicyLoss.DAPO)
def dapo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = 0.28,
    aggregation: str = LossAggregation.TOKEN_MEAN,
    **common: Unpack[CommonOptions],
) -> tuple[Tensor, PolicyLossMetrics]:
    """DAPO's policy loss (Yu et al. 2025): PPO-clip with a decoupled, asymmetric clip range ("clip-higher")
    reduced over the tokens of the whole batch ("token-level policy gradient loss")::

        per_token = w * max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps_high))
        loss      = sum_{b,t} mask * per_token / sum_{b,t} mask           (token_mean)

    with ``clip_eps = 0.2``, ``clip_eps_high = 0.28`` by default: a low-probability token may grow further
    before its gradient is cut, which keeps exploration (entropy) from collapsing. The same computation as
    :func:`ppo_clip` (shapes, options and metrics there); the rest of DAPO (dynamic sampling, overlong shaping)
    is outside the loss: ``FULMEN_TRAIN_ALGORITHM=dapo`` turns on all of it.
    """
    return ppo_clip(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        aggregation=aggregation,
        **common,
    )


@register_policy_loss(PolicyLoss.GSPO)
def gspo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 3e-4,
    clip_eps_high: float | None = 4e-4,
    aggregation: str = LossAggregation.SEQ_MEAN,
    **common: Unpack[CommonOptions],
) -> tuple[Tensor, PolicyLossMetrics]:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, length-normalised, clipped per sequence.

    With ``|y_b| = sum_t mask[b, t]`` and ``sg`` the stop-gradient (log-ratios clamped to +-20)::

        s_b       = exp( sum_t mask * (logprobs - old_logprobs) / |y_b| )      (the geometric-mean ratio)
        s_bt      = sg(s_b) * exp(logprobs - sg(logprobs))                   (value s_b; GSPO-token)
        per_token = w * max(-A * s_bt, -A * clip(s_bt, 1 - clip_eps, 1 + clip_eps_high))
        loss      = aggregate(per_token, mask, aggregation, normalizer)  (+ the KL penalty, as ppo_clip)

    With ``seq_mean`` (the default, as the paper) the gradient is exactly the paper's sequence objective,
    ``-mean_b grad min(s_b A_b, clip(s_b) A_b)``: ``grad s_bt = s_b grad logprobs[b, t]`` and the row mean
    gives ``grad s_b``. Clip range ``3e-4 / 4e-4`` by default (the paper's; a sequence ratio moves far less
    than a token's). Shapes as :func:`ppo_clip`; ``clip_fraction`` counts the tokens of clipped sequences.
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask, common)
    bounds = _clip_range(clip_eps, clip_eps_high)
    keep = mask.bool()
    token_log_ratio = (logprobs - old_logprobs).masked_fill(~keep, 0.0)
    lengths = keep.sum(dim=-1, keepdim=True).clamp_min(1).to(logprobs.dtype)
    seq_log_ratio = (token_log_ratio.sum(dim=-1, keepdim=True) / lengths).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(
        seq_log_ratio.detach() + logprobs - logprobs.detach()
    )  # value: the sequence's, gradient: the token's
    return _clipped_surrogate(ratio, token_log_ratio, logprobs, advantages, mask, bounds, aggregation, common)


@register_policy_loss(PolicyLoss.CISPO)
def cispo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 1.0,
    clip_eps_high: float | None = 3.0,
    aggregation: str = LossAggregation.TOKEN_MEAN,
    **common: Unpack[CommonOptions],
) -> tuple[Tensor, PolicyLossMetrics]:
    """CISPO (MiniMax-M1, Chen et al. 2025): the importance weight is clipped and detached; no token's gradient
    is ever cut (PPO's clip drops rare tokens whose ratio grows fast; CISPO only bounds their weight)::

        ratio     = exp(logprobs - old_logprobs)                              (log-ratio clamped to +-20)
        per_token = -w * sg(clip(ratio, 1 - clip_eps, 1 + clip_eps_high)) * A * logprobs
        loss      = aggregate(per_token, mask, aggregation, normalizer)  (+ the KL penalty, as ppo_clip)

    so ``grad = -w * clip(ratio) * A * grad logprobs``: REINFORCE with a truncated importance weight. Defaults:
    no lower bound (``clip_eps = 1``, as MiniMax-M1) and the weight capped at 4 (``clip_eps_high = 3``, as
    ScaleRL); token_mean. The loss VALUE is not a surrogate objective (it scales with ``logprobs``): compare
    gradients, not losses, with PPO's. ``clip_fraction``: tokens whose weight was clipped. Shapes as
    :func:`ppo_clip`.
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask, common)
    low, high = _clip_range(clip_eps, clip_eps_high)
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    coefficient = ratio.clamp(low, high).detach()
    per_token = -coefficient * advantages.to(logprobs.dtype)[:, None] * logprobs
    clipped = (ratio < low) | (ratio > high)
    return _finish(per_token, logprobs, log_ratio, ratio, clipped, mask, aggregation=aggregation, **common)
