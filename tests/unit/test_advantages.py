"""Advantage estimators: vectorised implementations held equal to a plain per-group loop; registry errors."""

from __future__ import annotations

import random
import statistics

import pytest
import torch

from fulmen.algorithm.rl.advantages import (
    AdvantageEstimator,
    compute_advantages,
    encode_group_ids,
    get_advantage_fn,
    register_advantage,
)
from fulmen.schemas.errors import ConfigurationError

EPS = 1e-6


def reference(name: str, rewards: list[float], groups: list[int]) -> list[float]:
    """The estimators written the slow, obvious way: one Python loop per sample over its group."""
    out = []
    for reward, group in zip(rewards, groups, strict=True):
        members = [r for r, g in zip(rewards, groups, strict=True) if g == group]
        n = len(members)
        mean = sum(members) / n
        if n == 1:
            out.append(0.0)
        elif name == "grpo":
            out.append((reward - mean) / (statistics.stdev(members) + EPS))
        elif name == "dr_grpo":
            out.append(reward - mean)
        else:  # rloo: the mean of the OTHER members
            out.append(reward - (sum(members) - reward) / (n - 1))
    return out


def random_batch(rng: random.Random) -> tuple[list[float], list[int]]:
    """Groups of size 1..6 with non-contiguous ids in shuffled order; some groups with all-equal rewards."""
    rewards, groups = [], []
    for _ in range(rng.randint(1, 8)):
        group = rng.randint(0, 10_000)
        size = rng.choice([1, 1, 2, 3, 4, 6])
        if rng.random() < 0.3:
            rewards += [rng.choice([0.0, 1.0, 0.3])] * size
        else:
            rewards += [rng.choice([0.0, 1.0, rng.uniform(-2, 2)]) for _ in range(size)]
        groups += [group] * size
    order = list(range(len(rewards)))
    rng.shuffle(order)
    return [rewards[i] for i in order], [groups[i] for i in order]


@pytest.mark.parametrize("name", list(AdvantageEstimator))
def test_matches_the_loop_reference_on_random_groups(name: str) -> None:
    rng = random.Random(1234)
    for _ in range(200):
        rewards, groups = random_batch(rng)
        got = get_advantage_fn(name)(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups))
        expected = torch.tensor(reference(name, rewards, groups), dtype=torch.float64)
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", list(AdvantageEstimator))
def test_lone_samples_and_equal_rewards_get_zero(name: str) -> None:
    rewards = torch.tensor([0.7, 1.0, 1.0, 1.0, -3.0])
    groups = torch.tensor([5, 9, 9, 9, 2])  # group 5 and group 2 have one sample each; group 9 all equal
    assert torch.equal(compute_advantages(name, rewards, groups), torch.zeros(5))


def test_grpo_uses_the_unbiased_std() -> None:
    advantages = compute_advantages("grpo", torch.tensor([0.0, 1.0]), torch.tensor([0, 0]))
    # mean 0.5, unbiased std sqrt(0.5) (the biased one would be 0.5 and give +-1)
    torch.testing.assert_close(advantages, torch.tensor([-0.5, 0.5]) / (0.5**0.5 + EPS))


def test_float32_in_float32_out_and_group_order_does_not_matter() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.25])
    groups = torch.tensor([3, 3, 3, 8, 8, 8])
    for name in AdvantageEstimator:
        forward = compute_advantages(name, rewards, groups)
        assert forward.dtype == torch.float32 and forward.shape == (6,)
        perm = torch.tensor([5, 0, 3, 1, 4, 2])
        torch.testing.assert_close(compute_advantages(name, rewards[perm], groups[perm]), forward[perm])


def test_bad_shapes_and_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\[N\]"):
        compute_advantages("grpo", torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        compute_advantages("grpo", torch.zeros(3), torch.zeros(3))


def test_empty_batch_gives_empty_advantages() -> None:
    assert compute_advantages("rloo", torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_encode_group_ids_is_dense_and_stable() -> None:
    assert encode_group_ids(["b", "a", "b", "c", "a"]).tolist() == [0, 1, 0, 2, 1]


def test_unknown_estimator_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigurationError, match="unknown advantage estimator 'gae'; valid: grpo, dr_grpo, rloo"):
        get_advantage_fn("gae")


def test_duplicate_registration_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="'grpo' is already registered"):

        @register_advantage(AdvantageEstimator.GRPO)
        def another_grpo(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
            return rewards

    assert get_advantage_fn("grpo").__name__ == "grpo"


def test_enum_and_string_names_find_the_same_function() -> None:
    assert get_advantage_fn(AdvantageEstimator.DR_GRPO) is get_advantage_fn("dr_grpo")
