"""Completing GRPO groups from transition batches: latest attempt per rollout, timeouts, staleness.

A :class:`GroupBook` knows the groups the dispatcher published (:meth:`GroupBook.expect`) and files each
arriving ``TransitionBatch`` under its group. Rules:

- latest attempt: a rollout's batch replaces the one it has only if its attempt is higher (a redelivered or
  older attempt is ignored);
- final rollout: a batch counts as final when the rollout SUCCEEDED or used its last attempt
  (``attempt >= max_attempts``); a failed attempt that the runner will retry is kept provisionally;
- complete group: ``size`` rollouts, all final -> closed at once (:meth:`GroupBook.add` returns it);
- timeout: ``timeout_s`` after dispatch an open group is closed by the :class:`IncompletePolicy` in force
  (registry ``INCOMPLETE_POLICIES``): ``train_partial`` keeps it when at least ``min_group_size`` rollouts
  arrived (provisional ones included), else drops it; ``drop`` drops it;
- unknown group (not dispatched by this process, or already closed): the batch is ignored and counted.

Staleness is judged when a step takes its groups (:func:`drop_stale`), against the version being trained
then, not when the batch arrived. Pure state, no I/O: the clock is injected.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import StrEnum

from fulmen.algorithm.rl.credit import assign_credit
from fulmen.algorithm.rl.registry import Registry
from fulmen.algorithm.service.dispatcher import DispatchedGroup
from fulmen.algorithm.settings import IncompletePolicy
from fulmen.schemas.events import RolloutMode, RolloutStatus, Transition, TransitionBatch

__all__ = [
    "INCOMPLETE_POLICIES",
    "AddOutcome",
    "ClosedGroup",
    "GroupBook",
    "credit_groups",
    "drop_stale",
    "drop_too_long",
    "keep_agents",
    "served_before",
    "shuffle_rewards",
    "validation_summary",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClosedGroup:
    """A group ready to use: its rollouts (latest attempt each, sorted by rollout id) and how it closed.

    ``partial``: closed by timeout with fewer than ``expected`` final rollouts. ``kept``: False when the policy
    dropped it (it is then only reported, never trained on).
    """

    group_id: str
    task_id: str
    mode: RolloutMode
    expected: int
    rollouts: tuple[TransitionBatch, ...]
    partial: bool = False
    kept: bool = True

    @property
    def num_transitions(self) -> int:
        return sum(len(r.transitions) for r in self.rollouts)


@dataclass
class _OpenGroup:
    spec: DispatchedGroup
    deadline: float
    rollouts: dict[str, TransitionBatch] = field(default_factory=dict)

    def final(self, batch: TransitionBatch) -> bool:
        return batch.status is RolloutStatus.SUCCEEDED or batch.attempt >= self.spec.max_attempts

    @property
    def complete(self) -> bool:
        return len(self.rollouts) >= self.spec.size and all(self.final(b) for b in self.rollouts.values())

    def close(self, *, partial: bool, kept: bool) -> ClosedGroup:
        spec = self.spec
        rollouts = tuple(self.rollouts[k] for k in sorted(self.rollouts))
        return ClosedGroup(spec.group_id, spec.task_id, spec.mode, spec.size, rollouts, partial, kept)


KeepFn = Callable[[int, int], bool]
"""``(rollouts arrived, min_group_size) -> keep the timed-out group?``"""

INCOMPLETE_POLICIES: Registry[KeepFn] = Registry("incomplete-group policy")
INCOMPLETE_POLICIES.register(IncompletePolicy.TRAIN_PARTIAL)(lambda arrived, least: arrived >= least)
INCOMPLETE_POLICIES.register(IncompletePolicy.DROP)(lambda arrived, least: False)


class AddOutcome(StrEnum):
    FILED = "filed"  # kept in its group (maybe replacing an older attempt)
    OLDER_ATTEMPT = "older_attempt"  # the group already has a later attempt of that rollout: ignored
    UNKNOWN_GROUP = "unknown_group"  # not a group in flight here: ignored


class GroupBook:
    """Open groups by id; see the module docstring for the rules."""

    def __init__(
        self,
        *,
        timeout_s: float,
        policy: str = IncompletePolicy.TRAIN_PARTIAL,
        min_group_size: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s = timeout_s
        self.keep = INCOMPLETE_POLICIES.get(policy)  # ConfigurationError listing the valid names
        self.policy = str(policy)
        self.min_group_size = min_group_size
        self.clock = clock
        self.open: dict[str, _OpenGroup] = {}
        self.ignored = 0

    def expect(self, spec: DispatchedGroup) -> None:
        """Start waiting for ``spec``'s rollouts; its timeout runs from now."""
        self.open[spec.group_id] = _OpenGroup(spec, self.clock() + self.timeout_s)

    def add(self, batch: TransitionBatch) -> tuple[AddOutcome, ClosedGroup | None]:
        """File ``batch``; the group too when this batch completed it (it is then no longer open)."""
        group = self.open.get(batch.group_id)
        if group is None:
            self.ignored += 1
            log.debug("ignoring rollout %s: group %s is not in flight here", batch.rollout_id, batch.group_id)
            return AddOutcome.UNKNOWN_GROUP, None
        current = group.rollouts.get(batch.rollout_id)
        # A rebuilt batch of the same attempt (a late span arrived) replaces the earlier build: newer created_at.
        if current is not None and (current.attempt, current.created_at) >= (batch.attempt, batch.created_at):
            return AddOutcome.OLDER_ATTEMPT, None
        group.rollouts[batch.rollout_id] = batch
        if not group.complete:
            return AddOutcome.FILED, None
        del self.open[batch.group_id]
        return AddOutcome.FILED, group.close(partial=False, kept=True)

    def expire(self) -> list[ClosedGroup]:
        """Close the groups past their deadline by the policy (kept or dropped); returns them."""
        now = self.clock()
        closed = []
        for group_id in [g for g, group in self.open.items() if group.deadline <= now]:
            group = self.open.pop(group_id)
            kept = self.keep(len(group.rollouts), self.min_group_size)
            closed.append(group.close(partial=True, kept=kept))
            log.warning(
                "group %s timed out with %d of %d rollouts: %s (policy %s)",
                group_id,
                len(group.rollouts),
                group.spec.size,
                "kept" if kept else "dropped",
                self.policy,
            )
        return closed

    def next_deadline(self) -> float | None:
        """The earliest deadline of the open groups (clock time), None when none is open."""
        return min((g.deadline for g in self.open.values()), default=None)


def drop_stale(group: ClosedGroup, current_version: int, max_staleness: int) -> tuple[ClosedGroup, int]:
    """``group`` without the transitions sampled by a version older than ``current_version - max_staleness``,
    and how many were dropped. A transition's version is its own ``model_version``, else its batch's; an
    unknown version (None) is kept. A rollout left without transitions stays in the group (it arrived; the
    advantage computation skips rollouts without transitions)."""
    oldest = current_version - max_staleness
    return _keep_transitions(group, lambda t, b: _version(t.model_version, b.model_version) >= oldest)


def drop_too_long(group: ClosedGroup, max_len: int | None) -> tuple[ClosedGroup, int]:
    """``group`` without the transitions whose prompt + response exceed ``max_len`` tokens (None: no limit),
    and how many were dropped (the trainer would refuse them)."""
    if max_len is None:
        return group, 0
    return _keep_transitions(group, lambda t, b: len(t.prompt_token_ids) + len(t.response_token_ids) <= max_len)


def keep_agents(group: ClosedGroup, agents: Collection[str]) -> tuple[ClosedGroup, int]:
    """``group`` with only the calls that ``agents`` made, and how many other calls were dropped (per-agent
    adapters: each agent's own group). Credit first: a call's credit comes from its whole rollout. A rollout where
    none of them made a call is left without transitions (the advantages skip it)."""
    return _keep_transitions(group, lambda t, b: t.agent_name in agents)


def shuffle_rewards(groups: list[ClosedGroup], seed: int) -> list[ClosedGroup]:
    """CONTROL RUNS ONLY (``FULMEN_TRAIN_SHUFFLE_REWARDS``): the same groups with the rewards of the step's
    rollouts permuted at random across all its groups, so the reward no longer belongs to the answer it
    scored and the learning signal is destroyed (the statistics of the rewards stay the same).

    Rollout ``r`` takes the whole reward record of rollout ``perm(r)``: its ``episode_reward`` and the
    ``intermediate_reward`` of its transitions, positionally (the last one repeated when ``r`` made more calls).
    Run it before :func:`credit_groups`, which credits what was shuffled.
    """
    import random

    records = [(b.episode_reward, [t.intermediate_reward for t in b.transitions]) for g in groups for b in g.rollouts]
    random.Random(seed).shuffle(records)
    source = iter(records)
    shuffled = []
    for group in groups:
        rollouts = []
        for batch in group.rollouts:
            episode, observed = next(source)
            transitions = [
                t.model_copy(update={"intermediate_reward": observed[min(i, len(observed) - 1)] if observed else None})
                for i, t in enumerate(batch.transitions)
            ]
            rollouts.append(batch.model_copy(update={"episode_reward": episode, "transitions": transitions}))
        shuffled.append(dataclasses.replace(group, rollouts=tuple(rollouts)))
    return shuffled


def credit_groups(groups: list[ClosedGroup], strategy: str, gamma: float = 1.0) -> list[ClosedGroup]:
    """The same groups with every transition's ``reward`` credited by ``strategy`` (``fulmen.algorithm.rl.credit``)
    from its rollout's ``episode_reward`` and the calls' ``intermediate_reward``: the run that trains chooses
    the credit (``FULMEN_TRAIN_CREDIT``), the transitions topic carries only what was observed. Only a
    succeeded rollout is credited; a failed or timed-out attempt's transitions keep ``reward=None``."""
    credited = []
    for group in groups:
        rollouts = []
        for batch in group.rollouts:
            rewards: list[float | None] = [None] * len(batch.transitions)
            if batch.status is RolloutStatus.SUCCEEDED and batch.transitions:
                observed = [t.intermediate_reward for t in batch.transitions]
                rewards = assign_credit(strategy, batch.episode_reward, observed, gamma)
            transitions = [t.model_copy(update={"reward": r}) for t, r in zip(batch.transitions, rewards, strict=True)]
            rollouts.append(batch.model_copy(update={"transitions": transitions}))
        credited.append(dataclasses.replace(group, rollouts=tuple(rollouts)))
    return credited


def _keep_transitions(
    group: ClosedGroup, keep: Callable[[Transition, TransitionBatch], bool]
) -> tuple[ClosedGroup, int]:
    dropped = 0
    rollouts = []
    for batch in group.rollouts:
        kept = [t for t in batch.transitions if keep(t, batch)]
        dropped += len(batch.transitions) - len(kept)
        if len(kept) != len(batch.transitions):  # indices keep their call positions (no re-validation)
            batch = batch.model_copy(update={"transitions": kept})
        rollouts.append(batch)
    return dataclasses.replace(group, rollouts=tuple(rollouts)), dropped


def _version(own: int | None, batch: int | None) -> float:
    version = own if own is not None else batch
    return float("inf") if version is None else version


def served_before(group: ClosedGroup, version: int, agents: list[str] | None = None) -> bool:
    """True when a call of the group was served by a model version older than ``version`` (per-agent adapters:
    a call of one of ``agents``, the others are served by the base model, version 0)."""
    return any(
        t.model_version is not None and t.model_version < version and (agents is None or t.agent_name in agents)
        for batch in group.rollouts
        for t in batch.transitions
    )


CORRECT_ABOVE = 0.5
"""A validation rollout is correct when its episode reward is above this."""


def validation_summary(groups: list[ClosedGroup], missing_reward: float) -> tuple[dict[str, float], dict[str, float]]:
    """A validation pass's figures (``accuracy``: the share of correct rollouts, ``reward_mean``, ``rollouts``;
    empty when none came back) and its outcomes per task (the share of the task's rollouts that were correct)."""
    rewards = [r.episode_reward for g in groups for r in g.rollouts]
    if not rewards:
        return {}, {}
    outcomes: dict[str, list[bool]] = {}
    for group in groups:
        for rollout in group.rollouts:
            correct = rollout.episode_reward is not None and rollout.episode_reward > CORRECT_ABOVE
            outcomes.setdefault(group.task_id, []).append(correct)
    figures = {
        "accuracy": sum(r is not None and r > CORRECT_ABOVE for r in rewards) / len(rewards),
        "reward_mean": sum(missing_reward if r is None else r for r in rewards) / len(rewards),
        "rollouts": float(len(rewards)),
    }
    return figures, {task: sum(flags) / len(flags) for task, flags in outcomes.items()}
