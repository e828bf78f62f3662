"""Credit assignment: each strategy on cases computed by hand, the registry's errors, and the run that trains
crediting the observed rewards of its groups (``credit_groups``; the shuffled control before it)."""

from __future__ import annotations

import pytest

from fulmen.algorithm.rl.credit import (
    CREDIT_STRATEGIES,
    CreditStrategy,
    assign_credit,
    credit_strategy,
    register_credit,
)
from fulmen.algorithm.service.groups import ClosedGroup, credit_groups, shuffle_rewards
from fulmen.algorithm.settings import TrainSettings
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import RolloutMode, RolloutStatus, Transition, TransitionBatch


def close(values: list[float | None], expected: list[float | None]) -> bool:
    if len(values) != len(expected):
        return False
    return all(
        (a is None and b is None) or (a is not None and b is not None and a == pytest.approx(b))
        for a, b in zip(values, expected, strict=True)
    )


def test_every_builtin_is_registered() -> None:
    assert set(CREDIT_STRATEGIES.names()) >= {s.value for s in CreditStrategy}


def test_broadcast_gives_every_call_the_episode_reward() -> None:
    assert assign_credit("broadcast", 0.5, [None, 0.3, None], gamma=0.5) == [0.5, 0.5, 0.5]
    assert assign_credit(CreditStrategy.BROADCAST, None, [None, None]) == [None, None]


def test_discounted_by_hand() -> None:
    # T = 3, R = 1, gamma = 0.5: [0.5^2, 0.5^1, 0.5^0]
    assert close(assign_credit("discounted", 1.0, [None, None, None], gamma=0.5), [0.25, 0.5, 1.0])
    # T = 4, R = -2, gamma = 0.9: [-2*0.729, -2*0.81, -2*0.9, -2]
    assert close(assign_credit("discounted", -2.0, [0.7] * 4, gamma=0.9), [-1.458, -1.62, -1.8, -2.0])
    assert assign_credit("discounted", None, [1.0, 2.0], gamma=0.9) == [None, None]


def test_intermediate_returns_to_go_by_hand() -> None:
    # i = [0.1, -, 0.2], R = 1, gamma = 0.5: G2 = 0.2 + 1 = 1.2; G1 = 0 + 0.5*1.2 = 0.6; G0 = 0.1 + 0.5*0.6 = 0.4
    assert close(assign_credit("intermediate", 1.0, [0.1, None, 0.2], gamma=0.5), [0.4, 0.6, 1.2])
    # gamma = 1: plain sums of what follows. i = [1, 2, 3], R = 10: [16, 15, 13]
    assert close(assign_credit("intermediate", 10.0, [1.0, 2.0, 3.0]), [16.0, 15.0, 13.0])


def test_intermediate_without_intermediate_rewards_equals_discounted() -> None:
    for gamma in (1.0, 0.9, 0.3):
        assert close(
            assign_credit("intermediate", 0.7, [None] * 5, gamma=gamma),
            assign_credit("discounted", 0.7, [None] * 5, gamma=gamma),
        )


def test_intermediate_without_episode_reward() -> None:
    # R missing counts 0 when something was observed: i = [-, 0.5], gamma = 0.8 -> [0.4, 0.5]
    assert close(assign_credit("intermediate", None, [None, 0.5], gamma=0.8), [0.4, 0.5])
    assert assign_credit("intermediate", None, [None, None]) == [None, None]


def test_no_calls_no_credit() -> None:
    for strategy in CreditStrategy:
        assert assign_credit(strategy, 1.0, []) == []


def test_unknown_strategy_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigurationError, match="valid: broadcast, discounted, intermediate"):
        credit_strategy("montecarlo")


def test_duplicate_registration_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="already registered"):
        register_credit(CreditStrategy.BROADCAST)(lambda r, i, g: [r] * len(i))
    assert CREDIT_STRATEGIES.get("broadcast").__name__ == "broadcast"


@pytest.mark.parametrize("gamma", [0.0, -0.5, 1.5])
def test_gamma_outside_the_unit_interval_is_refused(gamma: float) -> None:
    with pytest.raises(ConfigurationError, match="gamma"):
        assign_credit("discounted", 1.0, [None], gamma=gamma)


def test_non_finite_rewards_are_refused() -> None:
    with pytest.raises(ValueError, match="finite"):
        assign_credit("intermediate", float("nan"), [None])


# --- the run that trains credits the observed rewards ----------------------------------------------------------
def _batch(rollout: str, status: RolloutStatus, episode: float | None, observed: list[float | None]) -> TransitionBatch:
    transitions = [
        Transition(
            rollout_id=rollout,
            attempt=1,
            index=i,
            trace_id="a" * 32,
            span_id=f"{i + 1:016x}",
            prompt_token_ids=[1],
            response_token_ids=[2],
            intermediate_reward=value,
        )
        for i, value in enumerate(observed)
    ]
    return TransitionBatch(
        rollout_id=rollout,
        attempt=1,
        task_id="t",
        group_id="g",
        status=status,
        episode_reward=episode,
        transitions=transitions,
    )


def _group(*batches: TransitionBatch) -> ClosedGroup:
    return ClosedGroup("g", "t", RolloutMode.TRAIN, len(batches), tuple(batches))


def test_credit_groups_applies_the_runs_strategy_to_succeeded_rollouts_only() -> None:
    group = _group(
        _batch("a", RolloutStatus.SUCCEEDED, 1.0, [0.2, None, None]),
        _batch("b", RolloutStatus.FAILED, None, [0.2, None]),
    )
    rewards = {
        s: [[t.reward for t in b.transitions] for b in credit_groups([group], s, 0.5)[0].rollouts]
        for s in ("broadcast", "discounted", "intermediate")
    }
    assert rewards["broadcast"] == [[1.0, 1.0, 1.0], [None, None]]
    assert rewards["discounted"] == [[0.25, 0.5, 1.0], [None, None]]
    assert rewards["intermediate"][0] == pytest.approx([0.45, 0.5, 1.0]) and rewards["intermediate"][1] == [None] * 2
    assert [t.reward for t in group.rollouts[0].transitions] == [None] * 3  # the input is left as it was


def test_shuffled_control_permutes_what_was_observed_then_credit_follows_it() -> None:
    groups = [_group(*(_batch(f"r{k}", RolloutStatus.SUCCEEDED, float(k), [float(k), None]) for k in range(8)))]
    shuffled = credit_groups(shuffle_rewards(groups, seed=3), "intermediate", 1.0)
    pairs = [
        (b.episode_reward, b.transitions[0].intermediate_reward, b.transitions[0].reward) for b in shuffled[0].rollouts
    ]
    assert sorted(p[0] for p in pairs) == [float(k) for k in range(8)]  # the same rewards, moved
    assert [p[0] for p in pairs] != [float(k) for k in range(8)]
    assert all(intermediate == episode and credited == 2 * episode for episode, intermediate, credited in pairs)


def test_an_unknown_credit_strategy_for_the_run_lists_the_valid_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FULMEN_TRAIN_CREDIT", "discounted")
    monkeypatch.setenv("FULMEN_TRAIN_GAMMA", "0.9")
    assert (TrainSettings().train.credit, TrainSettings().train.gamma) == ("discounted", 0.9)
    monkeypatch.setenv("FULMEN_TRAIN_CREDIT", "nope")
    with pytest.raises(ValueError, match="FULMEN_TRAIN_CREDIT.*broadcast, discounted, intermediate"):
        TrainSettings()
