"""DAPO's overlong shaping held equal to its piecewise definition, and how the samples use it: the penalty enters
the rewards the estimator compares (a rollout's return gets its calls' penalties), and groups without signal."""

from __future__ import annotations

import pytest
import torch

from fulmen.algorithm.rl.shaping import OverlongShaping, overlong_penalty
from fulmen.algorithm.service.groups import ClosedGroup
from fulmen.algorithm.service.samples import build_samples, has_signal, scope_rewards
from fulmen.algorithm.settings import AdvantageScope
from fulmen.schemas.events import RolloutMode, RolloutStatus, Transition, TransitionBatch


def reference_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment, piece by piece (section 3.4 of the paper)."""
    if length <= max_tokens - buffer:
        return 0.0
    if length <= max_tokens:
        return penalty * ((max_tokens - buffer) - length) / buffer
    return -penalty


@pytest.mark.parametrize(("max_tokens", "buffer", "penalty"), [(20, 4, 1.0), (16, 16, 0.5), (10, 1, 2.0)])
def test_overlong_penalty_matches_the_piecewise_definition(max_tokens: int, buffer: int, penalty: float) -> None:
    lengths = torch.arange(0, 2 * max_tokens + 2)
    got = overlong_penalty(lengths, max_tokens, buffer, penalty).tolist()
    expected = [reference_penalty(n, max_tokens, buffer, penalty) for n in lengths.tolist()]
    assert got == pytest.approx(expected, abs=1e-12)
    assert OverlongShaping(max_tokens, buffer, penalty)(lengths).tolist() == got


def test_overlong_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="buffer_tokens <= max_tokens"):
        OverlongShaping(max_tokens=8, buffer_tokens=9)
    with pytest.raises(ValueError, match="max_tokens >= 1"):
        OverlongShaping(max_tokens=0, buffer_tokens=0)


def rollout(group: str, index: int, reward: float, lengths: list[int]) -> TransitionBatch:
    rollout_id = f"{group}-r{index}"
    calls = [
        Transition(
            rollout_id=rollout_id,
            attempt=1,
            index=i,
            trace_id="a" * 32,
            span_id=f"{i:016x}",
            prompt_token_ids=[1, 2],
            response_token_ids=[7] * n,
            reward=reward,
        )
        for i, n in enumerate(lengths)
    ]
    return TransitionBatch(
        rollout_id=rollout_id,
        attempt=1,
        task_id=f"task-{group}",
        group_id=group,
        status=RolloutStatus.SUCCEEDED,
        episode_reward=reward,
        transitions=calls,
    )


def group(name: str, *rollouts: tuple[float, list[int]]) -> ClosedGroup:
    batches = tuple(rollout(name, i, reward, lengths) for i, (reward, lengths) in enumerate(rollouts))
    return ClosedGroup(name, f"task-{name}", RolloutMode.TRAIN, len(batches), batches)


SHAPING = OverlongShaping(max_tokens=10, buffer_tokens=4)  # no penalty up to 6 tokens, -1 from 10


def test_episode_returns_get_the_sum_of_their_calls_penalties() -> None:
    groups = [group("g", (1.0, [3]), (1.0, [8]), (1.0, [3, 12]))]
    units, rewards, penalties = scope_rewards(groups, AdvantageScope.EPISODE, overlong=SHAPING)
    assert [len(u.transitions) for u in units] == [1, 1, 2]
    assert penalties.tolist() == pytest.approx([0.0, -0.5, -1.0])
    assert rewards.tolist() == pytest.approx([1.0, 0.5, 0.0])
    data = build_samples(groups, estimator="dr_grpo", overlong=SHAPING)
    assert [s.advantage for s in data.samples] == pytest.approx([0.5, 0.0, -0.5, -0.5])  # mean 0.5
    assert data.returns == [1.0, 1.0, 1.0]  # reported unshaped
    assert data.overlong_penalized == 2
    plain = build_samples(groups, estimator="dr_grpo")
    assert [s.advantage for s in plain.samples] == [0.0] * 4 and plain.overlong_penalized == 0


def test_transition_scope_penalises_each_call_alone() -> None:
    groups = [group("g", (1.0, [3, 12]), (0.0, [8]))]
    _, rewards, penalties = scope_rewards(groups, AdvantageScope.TRANSITION, overlong=SHAPING)
    assert penalties.tolist() == pytest.approx([0.0, -1.0, -0.5])
    assert rewards.tolist() == pytest.approx([1.0, 0.0, -0.5])


def test_has_signal_is_false_only_when_the_compared_rewards_are_all_equal() -> None:
    same = group("g", (1.0, [3]), (1.0, [4]), (1.0, [5]))
    assert not has_signal(same, AdvantageScope.EPISODE)
    assert has_signal(same, AdvantageScope.EPISODE, overlong=OverlongShaping(max_tokens=5, buffer_tokens=2))
    assert has_signal(group("g", (1.0, [3]), (0.0, [3])), AdvantageScope.EPISODE)
    assert not has_signal(group("g", (1.0, [3])), AdvantageScope.EPISODE)  # one rollout: no baseline, no signal
    mixed_calls = group("g", (1.0, [3, 3]), (1.0, [3]))
    assert not has_signal(mixed_calls, AdvantageScope.TRANSITION)
