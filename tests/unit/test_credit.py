"""Credit assignment: each strategy on cases computed by hand, the registry's errors."""

from __future__ import annotations

import pytest

from fulmen.algorithm.credit import CREDIT_STRATEGIES, CreditStrategy, assign_credit, credit_strategy, register_credit
from fulmen.schemas.errors import ConfigurationError


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
