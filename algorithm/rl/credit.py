"""Credit assignment (LightningRL): from an episode's reward and its per-call rewards to one reward per call.

An episode (a rollout) is a sequence of T selected LLM calls, t = 0 .. T-1, in the order they were made. Its
outcome is the episode reward R (None when the rollout gave none); a call may also be followed by an
intermediate reward i_t (None where nothing was observed). A strategy turns (R, [i_0 .. i_{T-1}]) into the
reward r_t that a single-step algorithm (GRPO, PPO-clip) trains call t on. Strategies are pure functions on
lists of floats (no torch, no I/O), registered by name in a :class:`CreditStrategy`-keyed registry:

* ``broadcast``:    r_t = R
* ``discounted``:   r_t = gamma^(T-1-t) * R
* ``intermediate``: r_t = sum_{k=t}^{T-1} gamma^(k-t) * i_k  +  gamma^(T-1-t) * R
  (returns-to-go of the intermediate rewards, i_k = 0 where none was observed, plus the discounted episode
  reward, as if R arrived right after the last call)
* ``anchor``:       r_t as ``intermediate`` (the call's own return); the trainer then compares each call with
  the calls of its group that saw the same prompt and adds that step advantage to the episode advantage
  (GiGPO's anchor states, length-normalised: ``fulmen.algorithm.rl.anchor``, which states the estimator)

Where a strategy has nothing to credit (R is None; for ``intermediate``, R is None and no call has an
intermediate reward) every r_t is None: "no reward", which the trainer must not read as 0. When only R is
missing, ``intermediate`` counts it as 0 and credits the intermediate rewards alone.

Registering a name twice raises :class:`ConfigurationError`; so does asking for an unknown name, and that
error lists the valid ones (``fulmen.algorithm.rl.registry``). The transitions consumer imports this module (the one
import from ``consumers`` into ``algorithm``: pure math with no dependency beyond the registry and the errors).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Protocol

from fulmen.algorithm.rl.registry import Registry
from fulmen.schemas.errors import ConfigurationError

__all__ = [
    "CREDIT_STRATEGIES",
    "CreditFn",
    "CreditStrategy",
    "assign_credit",
    "broadcast",
    "credit_strategy",
    "discounted",
    "intermediate",
    "register_credit",
]


class CreditStrategy(StrEnum):
    """The built-in strategies (see the module docstring for their formulas)."""

    BROADCAST = "broadcast"
    DISCOUNTED = "discounted"
    INTERMEDIATE = "intermediate"
    ANCHOR = "anchor"


class CreditFn(Protocol):
    """``(episode_reward R, intermediate rewards [i_0 .. i_{T-1}], gamma) -> [r_0 .. r_{T-1}]`` (same length)."""

    def __call__(
        self, episode_reward: float | None, intermediate: Sequence[float | None], gamma: float
    ) -> list[float | None]: ...


CREDIT_STRATEGIES: Registry[CreditFn] = Registry("credit strategy")


def register_credit(name: str) -> Callable[[CreditFn], CreditFn]:
    """Decorator: register a strategy under ``name``; a name registered twice raises ConfigurationError."""
    return CREDIT_STRATEGIES.register(name)


def credit_strategy(name: str) -> CreditFn:
    """The strategy registered under ``name``; ConfigurationError listing the valid names otherwise."""
    return CREDIT_STRATEGIES.get(name)


def assign_credit(
    name: str, episode_reward: float | None, intermediate: Sequence[float | None], gamma: float = 1.0
) -> list[float | None]:
    """Run strategy ``name``. ``gamma`` must be in (0, 1]; every given reward must be finite."""
    if not 0.0 < gamma <= 1.0:
        raise ConfigurationError(f"gamma must be in (0, 1], not {gamma!r} (1.0 = no discount)")
    for value in (episode_reward, *intermediate):
        if value is not None and not math.isfinite(value):
            raise ValueError(f"rewards must be finite numbers, got {value!r}")
    return credit_strategy(name)(episode_reward, intermediate, gamma)


@register_credit(CreditStrategy.BROADCAST)
def broadcast(episode_reward: float | None, intermediate: Sequence[float | None], gamma: float) -> list[float | None]:
    """r_t = R for every call; gamma and the intermediate rewards are ignored."""
    return [episode_reward] * len(intermediate)


@register_credit(CreditStrategy.DISCOUNTED)
def discounted(episode_reward: float | None, intermediate: Sequence[float | None], gamma: float) -> list[float | None]:
    """r_t = gamma^(T-1-t) * R: the last call gets R, each earlier one a factor gamma less."""
    if episode_reward is None:
        return [None] * len(intermediate)
    last = len(intermediate) - 1
    return [gamma ** (last - t) * episode_reward for t in range(len(intermediate))]


@register_credit(CreditStrategy.INTERMEDIATE)
def intermediate(
    episode_reward: float | None, intermediate: Sequence[float | None], gamma: float
) -> list[float | None]:
    """r_t = sum_{k>=t} gamma^(k-t) * i_k + gamma^(T-1-t) * R, computed backwards: G_{T-1} = i_{T-1} + R,
    G_t = i_t + gamma * G_{t+1} (a missing i_k counts 0; a missing R counts 0 unless nothing was observed)."""
    if episode_reward is None and all(value is None for value in intermediate):
        return [None] * len(intermediate)
    credited: list[float | None] = [None] * len(intermediate)
    following = episode_reward or 0.0  # what arrives after call t, already discounted to t + 1
    for t in range(len(intermediate) - 1, -1, -1):
        following = (intermediate[t] or 0.0) + following
        credited[t] = following
        following *= gamma
    return credited


# The anchor strategy's per-call reward is the return from that call on (what the step groups compare); its
# cross-rollout part needs the whole group and lives with the advantages (fulmen.algorithm.rl.anchor).
register_credit(CreditStrategy.ANCHOR)(intermediate)
