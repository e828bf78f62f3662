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

Each scope yields :class:`Unit` s (one reward, its group, the transitions sharing its advantage). With overlong
shaping (:class:`~fulmen.algorithm.rl.shaping.OverlongShaping`, DAPO) every call's penalty for its response length
is added to its unit's reward: a rollout's return gets the sum of its calls' penalties. :func:`has_signal` says
whether a group's (shaped) rewards differ at all, for DAPO's dynamic sampling.

With the ``anchor`` credit (``step_weight`` set: :func:`fulmen.algorithm.rl.anchor.anchor_advantages`) each call's
advantage becomes ``lambda * (A_scope + step_weight * A_step)``: ``A_step`` compares the call's credited return
with those of the calls of its group that saw the same prompt (0 without such a peer), ``lambda`` weighs each
call ``1 / T`` of its episode (rescaled by the step's mean calls per episode), so longer episodes gain nothing.

Only rollouts that still have transitions enter the estimator (staleness may have emptied some). Transitions
keep their exact token ids and recorded logprobs (``Sample.old_logprobs``, the behaviour policy's; None when
not recorded).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fulmen.algorithm.batch import Sample
from fulmen.algorithm.rl.advantages import compute_advantages, encode_group_ids
from fulmen.algorithm.rl.anchor import anchor_advantages, step_group_ids
from fulmen.algorithm.rl.registry import Registry
from fulmen.algorithm.rl.shaping import OverlongShaping
from fulmen.algorithm.service.groups import ClosedGroup, keep_agents
from fulmen.algorithm.settings import AdvantageScope
from fulmen.schemas.events import Transition, TransitionBatch

__all__ = [
    "ADVANTAGE_SCOPES",
    "StepSamples",
    "Unit",
    "build_agent_samples",
    "build_samples",
    "has_signal",
    "rollout_return",
    "sampled_entropy",
    "scope_rewards",
    "staleness_counts",
    "staleness_extra",
]


@dataclass(frozen=True)
class StepSamples:
    """The samples of one step and the statistics a ``TrainStep`` reports.

    ``returns``: one value per rollout that has transitions (``R_r`` above, unshaped); ``advantages``: one per
    sample; ``overlong_penalized``: units (rollouts or calls, by scope) whose reward the overlong shaping lowered.
    """

    samples: list[Sample]
    returns: list[float]
    advantages: list[float]
    overlong_penalized: int = 0

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


@dataclass(frozen=True)
class Unit:
    """What the estimator compares: one reward in a group, and the transitions that share its advantage
    (a rollout's calls for the episode scope, one call for the transition scope)."""

    group_id: str
    reward: float
    transitions: tuple[Transition, ...]


ScopeFn = Callable[[Sequence[ClosedGroup], float], list[Unit]]
"""``(groups, missing_reward) -> the units of the groups, in group, rollout, call order``."""

ADVANTAGE_SCOPES: Registry[ScopeFn] = Registry("advantage scope")


def rollout_return(batch: TransitionBatch, missing_reward: float = 0.0) -> float:
    """``R_r``: the episode reward, else the first call's credited reward, else ``missing_reward``."""
    if batch.episode_reward is not None:
        return float(batch.episode_reward)
    if batch.transitions and batch.transitions[0].reward is not None:
        return float(batch.transitions[0].reward)
    return float(missing_reward)


@ADVANTAGE_SCOPES.register(AdvantageScope.EPISODE)
def _episode_scope(groups: Sequence[ClosedGroup], missing: float) -> list[Unit]:
    return [
        Unit(g.group_id, rollout_return(r, missing), tuple(r.transitions))
        for g in groups
        for r in g.rollouts
        if r.transitions
    ]


@ADVANTAGE_SCOPES.register(AdvantageScope.TRANSITION)
def _transition_scope(groups: Sequence[ClosedGroup], missing: float) -> list[Unit]:
    return [
        Unit(g.group_id, missing if t.reward is None else float(t.reward), (t,))
        for g in groups
        for r in g.rollouts
        for t in r.transitions
    ]


def scope_rewards(
    groups: Sequence[ClosedGroup], scope: str, missing_reward: float = 0.0, overlong: OverlongShaping | None = None
) -> tuple[list[Unit], Tensor, Tensor]:
    """The units of ``groups`` under ``scope``, the rewards the estimator compares (float64 ``[U]``: each unit's
    reward plus the overlong penalties of its calls) and those penalties alone (``[U]``, 0 without shaping)."""
    units = ADVANTAGE_SCOPES.get(scope)(groups, missing_reward)
    rewards = torch.tensor([u.reward for u in units], dtype=torch.float64)
    penalties = torch.zeros_like(rewards)
    if overlong is not None and units:
        lengths = torch.tensor([len(t.response_token_ids) for u in units for t in u.transitions])
        owner = torch.tensor([i for i, u in enumerate(units) for _ in u.transitions])
        penalties.index_add_(0, owner, overlong(lengths))
    return units, rewards + penalties, penalties


def has_signal(
    group: ClosedGroup, scope: str, missing_reward: float = 0.0, overlong: OverlongShaping | None = None
) -> bool:
    """Whether the rewards the estimator compares within ``group`` differ (DAPO's dynamic sampling keeps only
    such groups: equal rewards give every sample advantage 0, hence no gradient). Credit ``group`` first."""
    _, rewards, _ = scope_rewards([group], scope, missing_reward, overlong)
    return rewards.numel() > 1 and bool(rewards.max() > rewards.min())


def build_samples(
    groups: Sequence[ClosedGroup],
    *,
    estimator: str = "grpo",
    scope: str = AdvantageScope.EPISODE,
    missing_reward: float = 0.0,
    overlong: OverlongShaping | None = None,
    step_weight: float | None = None,
) -> StepSamples:
    """One sample per transition of ``groups`` (see the module docstring), in group, rollout, call order.
    ``step_weight``: the anchor credit's weight (``TrainSection.step_advantage_weight``); None: no step groups."""
    units, rewards, penalties = scope_rewards(groups, scope, missing_reward, overlong)
    returns = [rollout_return(r, missing_reward) for g in groups for r in g.rollouts if r.transitions]
    if not units:
        return StepSamples([], returns, [])
    advantages = compute_advantages(estimator, rewards, encode_group_ids(u.group_id for u in units))
    per_call = [
        (unit.group_id, t, advantage)
        for unit, advantage in zip(units, advantages.tolist(), strict=True)
        for t in unit.transitions
    ]
    if step_weight is not None:
        per_call = _with_step_advantages(groups, per_call, estimator, missing_reward, step_weight)
    samples = [
        Sample(
            prompt_token_ids=t.prompt_token_ids,
            response_token_ids=t.response_token_ids,
            advantage=advantage,
            old_logprobs=t.response_logprobs,
            group_id=group_id,
            model_version=t.model_version,
        )
        for group_id, t, advantage in per_call
    ]
    penalized = int((penalties < 0).sum()) if overlong is not None else 0
    return StepSamples(samples, returns, [s.advantage for s in samples], penalized)


def build_agent_samples(groups: Sequence[ClosedGroup], agents: Sequence[str], **options: Any) -> StepSamples:
    """Per-agent adapters (``FULMEN_TRAIN_ADAPTERS=per_agent``): for each of ``agents``, the samples of its own
    calls with advantages computed within its own groups (:func:`~fulmen.algorithm.service.groups.keep_agents`: the
    rollouts of a group in which it acted, each with its calls' credit), tagged with the agent; calls of other agents
    are not trained. ``returns`` are those of the whole rollouts, as :func:`build_samples` reports them. ``options``:
    those of :func:`build_samples`."""
    missing = options.get("missing_reward", 0.0)
    returns = [rollout_return(r, missing) for g in groups for r in g.rollouts if r.transitions]
    samples: list[Sample] = []
    penalized = 0
    for agent in agents:
        part = build_samples([keep_agents(g, {agent})[0] for g in groups], **options)
        samples += [dataclasses.replace(s, agent=agent) for s in part.samples]
        penalized += part.overlong_penalized
    return StepSamples(samples, returns, [s.advantage for s in samples], penalized)


def _with_step_advantages(
    groups: Sequence[ClosedGroup],
    per_call: list[tuple[str, Transition, float]],
    estimator: str,
    missing_reward: float,
    weight: float,
) -> list[tuple[str, Transition, float]]:
    """``per_call`` (group, call, scope advantage; group, rollout, call order) with the anchor advantages."""
    rollouts = [r for g in groups for r in g.rollouts if r.transitions]
    episodes = torch.tensor([k for k, r in enumerate(rollouts) for _ in r.transitions], dtype=torch.long)
    calls = [t for _, t, _ in per_call]
    if len(calls) != episodes.numel():  # the scopes list calls in group, rollout, call order: a defect otherwise
        raise ValueError(f"{len(calls)} scoped calls for {episodes.numel()} calls of the groups' rollouts")
    combined = anchor_advantages(
        torch.tensor([a for _, _, a in per_call], dtype=torch.float64),
        torch.tensor([missing_reward if t.reward is None else float(t.reward) for t in calls], dtype=torch.float64),
        step_group_ids([g for g, _, _ in per_call], [t.prompt_token_ids for t in calls]),
        episodes,
        estimator=estimator,
        weight=weight,
    )
    return [(g, t, a) for (g, t, _), a in zip(per_call, combined.tolist(), strict=True)]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _std(values: Sequence[float]) -> float:
    """Population standard deviation (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


# -- what a step's samples say (its TrainStep.extra) ---------------------------------------------------------


def staleness_counts(samples: list, version: int) -> dict[int, int]:
    """How many of ``samples`` were produced how many versions before ``version`` (the policy they train): a
    sample's staleness is that of its own call (``Sample.model_version``); samples of unknown version are left out."""
    counts: dict[int, int] = {}
    for sample in samples:
        if sample.model_version is not None:
            lag = max(version - sample.model_version, 0)
            counts[lag] = counts.get(lag, 0) + 1
    return counts


def staleness_extra(counts: dict[int, int]) -> dict[str, float]:
    """``staleness_<k>``: samples k versions old; ``staleness_max``/``_mean`` over the step's samples."""
    if not counts:
        return {}
    total = sum(counts.values())
    extra = {f"staleness_{lag}": float(n) for lag, n in sorted(counts.items())}
    extra["staleness_max"] = float(max(counts))
    extra["staleness_mean"] = sum(lag * n for lag, n in counts.items()) / total
    return extra


def sampled_entropy(samples: list[Sample]) -> float | None:
    """The sampling policy's entropy per response token, estimated as the mean negative logprob of the tokens it
    sampled (an unbiased Monte Carlo estimate at the sampling temperature); None when no logprob was recorded."""
    logprobs = [lp for s in samples if s.old_logprobs for lp in s.old_logprobs]
    return -sum(logprobs) / len(logprobs) if logprobs else None
