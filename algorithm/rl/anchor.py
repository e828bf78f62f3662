"""Anchor-state credit (the GiGPO idea): per-call advantages from calls that acted in the same state.

GiGPO (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training") observes that the
rollouts of one task often reach the same state: the first prompt always, later prompts whenever two rollouts
did the same thing so far. Calls made in one state are answers to one question, so they can be compared like
the samples of a GRPO group, which tells a good call from a bad one inside an episode whose outcome they share.

Notation, within one step: episode (rollout) ``e`` with ``T_e`` calls; call ``i`` of episode ``e(i)``;
``A_ep(i)``: the episode advantage its scope gives call ``i`` (with the ``episode`` scope, the group-normalised
return of ``e(i)``); ``G_i``: the call's credited return (from the ``anchor`` credit strategy: the discounted
return from call ``i`` to the episode end, ``gamma^(T-1-t) * R`` plus the intermediate rewards that follow;
the episode reward when ``gamma = 1`` and no intermediate reward was observed). The step group ``S(i)`` is the
calls of the same GRPO group whose prompt token ids equal call ``i``'s (hashed: :func:`step_group_ids`)::

    A_step(i) = estimator({G_j : j in S(i)})[i]        (grpo: (G_i - mean_S) / (std_S + eps); 0 when |S(i)| = 1)
    lambda(i) = (N / E) / T_e(i)                        (N calls and E episodes in the step)
    A(i)      = lambda(i) * (A_ep(i) + w * A_step(i))   (w = anchor_weight, 1.0 as in GiGPO)

A call without a peer (``|S(i)| = 1``) or whose peers earned the same return gets ``A_step = 0``: it falls back
to the episode advantage. ``lambda`` is the length normalisation: each call weighs ``1 / T_e`` of its episode, so
an episode's total advantage mass ``sum_{i in e} A(i) = (N / E) * (A_ep + w * mean_{i in e} A_step(i))`` is a
MEAN over its calls, never a sum: an episode that adds calls which change nothing (same reward) does not gain
weight against a shorter one. The factor ``N / E`` (the step's mean calls per episode) keeps the step's total
weight at ``N``, as without the normalisation, so the learning rate means the same (it is 1 when every episode
has the same number of calls). Under the ``seq_mean`` loss aggregation that mass is the episode's gradient
weight exactly; under ``token_mean`` each call's weight is further spread over its response tokens.

Pure functions on tensors (only torch and the estimator registry): the vectorised path uses scatter ops through
the registered estimators, never a Python loop over groups.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from fulmen.algorithm.rl.advantages import compute_advantages, encode_group_ids

__all__ = ["anchor_advantages", "episode_length_weights", "prompt_key", "step_group_ids"]


def prompt_key(prompt_token_ids: Sequence[int]) -> bytes:
    """A digest of a prompt's token ids: equal ids give equal keys (BLAKE2b, 16 bytes; ids as signed 64-bit)."""
    return hashlib.blake2b(
        b"".join(int(t).to_bytes(8, "little", signed=True) for t in prompt_token_ids), digest_size=16
    ).digest()


def step_group_ids(group_ids: Sequence[Hashable], prompts: Sequence[Sequence[int]]) -> Tensor:
    """Dense step-group ids ``[N]``: calls share one when they are in the same GRPO group AND have the same
    prompt token ids (the same state reached by different rollouts of one task)."""
    if len(group_ids) != len(prompts):
        raise ValueError(f"one group id per prompt: got {len(group_ids)} ids for {len(prompts)} prompts")
    return encode_group_ids((g, prompt_key(p)) for g, p in zip(group_ids, prompts, strict=True))


def episode_length_weights(episode_ids: Tensor) -> Tensor:
    """``lambda [N]`` (float64): ``(N / E) / T_e`` for each call of episode ``e`` (module docstring); the calls
    of one episode sum to ``N / E`` whatever its length, and all of them to ``N``."""
    if episode_ids.ndim != 1:
        raise ValueError(f"episode_ids must be [N]; got {tuple(episode_ids.shape)}")
    if not episode_ids.numel():
        return torch.zeros(0, dtype=torch.float64)
    _, inverse = torch.unique(episode_ids, return_inverse=True)
    counts = torch.zeros(int(inverse.max()) + 1, dtype=torch.float64).index_add_(
        0, inverse, torch.ones(inverse.numel(), dtype=torch.float64)
    )
    mean_calls = episode_ids.numel() / counts.numel()
    return mean_calls / counts[inverse]


def anchor_advantages(
    episode_advantages: Tensor,
    returns: Tensor,
    step_ids: Tensor,
    episode_ids: Tensor,
    *,
    estimator: str = "grpo",
    weight: float = 1.0,
    eps: float = 1e-6,
) -> Tensor:
    """``A [N]`` (module docstring): every input is ``[N]``, one entry per call (``episode_advantages`` and
    ``returns`` float, ``step_ids`` and ``episode_ids`` integer); returned in ``episode_advantages``' dtype."""
    if not (episode_advantages.shape == returns.shape == step_ids.shape == episode_ids.shape):
        raise ValueError(
            "episode_advantages, returns, step_ids and episode_ids must all be [N]; got "
            f"{[tuple(t.shape) for t in (episode_advantages, returns, step_ids, episode_ids)]}"
        )
    if weight < 0:
        raise ValueError(f"the anchor weight must be >= 0, not {weight!r}")
    step = compute_advantages(estimator, returns.to(torch.float64), step_ids, eps)
    combined = episode_advantages.to(torch.float64) + weight * step
    return (episode_length_weights(episode_ids) * combined).to(episode_advantages.dtype)
