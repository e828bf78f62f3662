"""Closed groups -> training samples: one :class:`~fulmen.algorithm.batch.Sample` per transition, with its advantage.

The advantage comes from the registry estimator (``grpo``, ``dr_grpo``, ``rloo``) applied within each group.
WHICH rewards it compares is the advantage scope (registry ``ADVANTAGE_SCOPES``, keyed by
:class:`~fulmen.algorithm.settings.AdvantageScope`):

- ``episode`` (default): each rollout's return ``R_r`` is normalised against the group's returns,
  ``A_r = estimator(R)[r]``, and every transition of rollout ``r`` gets ``A_r``. ``R_r`` is the rollout's episode
  reward; when the batch has none, the credited reward of its first call (the return-to-go from the start of
  the episode, which the credit strategies give the first call); else ``missing_reward``. This is GRPO's
  outcome advantage, broadcast over the calls of the episode: it does not depend on how many calls a rollout
  made, and a rollout is compared only with other answers to the same task.
- ``transition``: every transition's credited reward (``Transition.reward``, ``missing_reward`` when None) is
  normalised against ALL the transitions of its group (agent-lightning's choice). It honours per-call credit
  (``discounted``, ``intermediate``); rollouts with more calls weigh more in the group's baseline.

Only rollouts that still have transitions enter the estimator (staleness may have emptied some). Transitions
keep their exact token ids and recorded logprobs (``Sample.old_logprobs``; None when not recorded).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fulmen.algorithm.advantages import compute_advantages, encode_group_ids
from fulmen.algorithm.batch import Sample
from fulmen.algorithm.groups import ClosedGroup
from fulmen.algorithm.registry import Registry
from fulmen.algorithm.settings import AdvantageScope
from fulmen.schemas.events import Transition, TransitionBatch

__all__ = ["ADVANTAGE_SCOPES", "StepSamples", "build_samples", "rollout_return"]


@dataclass(frozen=True)
class StepSamples:
    """The samples of one step and the statistics a ``TrainStep`` reports.

    ``returns``: one value per rollout that has transitions (``R_r`` above); ``advantages``: one per sample.
    """

    samples: list[Sample]
    returns: list[float]
    advantages: list[float]

    @property
    def reward_mean(self) -> float:
        return _mean(self.returns)

    @property
    def reward_std(self) -> float:
        return _std(self.returns)

    @property
    def advantage_mean(self) -> float:
        return _mean(self.advantages)

    @property
    def advantage_std(self) -> float:
        return _std(self.advantages)


ScopeFn = Callable[[Sequence[ClosedGroup], str, float], list[tuple[Transition, str, float]]]
"""``(groups, estimator, missing_reward) -> [(transition, group_id, advantage)]``."""

ADVANTAGE_SCOPES: Registry[ScopeFn] = Registry("advantage scope")


def rollout_return(batch: TransitionBatch, missing_reward: float = 0.0) -> float:
    """``R_r``: the episode reward, else the first call's credited reward, else ``missing_reward``."""
    if batch.episode_reward is not None:
        return float(batch.episode_reward)
    if batch.transitions and batch.transitions[0].reward is not None:
        return float(batch.transitions[0].reward)
    return float(missing_reward)


@ADVANTAGE_SCOPES.register(AdvantageScope.EPISODE)
def _episode_scope(
    groups: Sequence[ClosedGroup], estimator: str, missing: float
) -> list[tuple[Transition, str, float]]:
    rollouts = [(g.group_id, r) for g in groups for r in g.rollouts if r.transitions]
    if not rollouts:
        return []
    returns = torch.tensor([rollout_return(r, missing) for _, r in rollouts], dtype=torch.float64)
    advantages = compute_advantages(estimator, returns, encode_group_ids(g for g, _ in rollouts)).tolist()
    return [(t, group_id, a) for (group_id, r), a in zip(rollouts, advantages, strict=True) for t in r.transitions]


@ADVANTAGE_SCOPES.register(AdvantageScope.TRANSITION)
def _transition_scope(
    groups: Sequence[ClosedGroup], estimator: str, missing: float
) -> list[tuple[Transition, str, float]]:
    items = [(t, g.group_id) for g in groups for r in g.rollouts for t in r.transitions]
    if not items:
        return []
    rewards = torch.tensor([missing if t.reward is None else t.reward for t, _ in items], dtype=torch.float64)
    advantages = compute_advantages(estimator, rewards, encode_group_ids(g for _, g in items)).tolist()
    return [(t, g, a) for (t, g), a in zip(items, advantages, strict=True)]


def build_samples(
    groups: Sequence[ClosedGroup],
    *,
    estimator: str = "grpo",
    scope: str = AdvantageScope.EPISODE,
    missing_reward: float = 0.0,
) -> StepSamples:
    """One sample per transition of ``groups`` (see the module docstring), in group, rollout, call order."""
    scored = ADVANTAGE_SCOPES.get(scope)(groups, estimator, missing_reward)
    samples = [
        Sample(
            prompt_token_ids=t.prompt_token_ids, response_token_ids=t.response_token_ids, advantage=advantage,
            old_logprobs=t.response_logprobs, group_id=group_id, model_version=t.model_version,
        )
        for t, group_id, advantage in scored
    ]  # fmt: skip
    returns = [rollout_return(r, missing_reward) for g in groups for r in g.rollouts if r.transitions]
    return StepSamples(samples, returns, [s.advantage for s in samples])


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _std(values: Sequence[float]) -> float:
    """Population standard deviation (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
