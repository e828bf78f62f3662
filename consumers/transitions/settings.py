"""Settings of the transitions consumer (``FULMEN_TRANSITIONS_*``) and of the consumers process that runs it."""

from __future__ import annotations

import re

from pydantic import BaseModel, Field, field_validator

from fulmen.algorithm.credit import CreditStrategy, credit_strategy
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas.errors import ConfigurationError

__all__ = ["ConsumersSettings", "TransitionsSection"]


class TransitionsSection(BaseModel):
    """``FULMEN_TRANSITIONS_AGENT_PATTERN``, ``FULMEN_TRANSITIONS_CREDIT``, ``FULMEN_TRANSITIONS_GAMMA``..."""

    agent_pattern: str | None = Field(
        default=None,
        description="train only the calls of agents whose name matches this regex as a whole; unset = all calls",
    )
    credit: str = Field(default=CreditStrategy.BROADCAST.value, description="credit assignment strategy (a name)")
    gamma: float = Field(default=1.0, gt=0, le=1, description="discount of the discounted/intermediate strategies")
    barrier_timeout_s: float = Field(
        default=30.0, gt=0, description="warn when the spans consumer has not caught up by then (then keep waiting)"
    )
    late_window_s: float = Field(
        default=60.0, ge=0, le=24 * 3600,
        description="how long after its build a rollout is watched for late spans (rebuilt if any); 0 = never",
    )  # fmt: skip
    late_check_interval_s: float = Field(default=2.0, gt=0, description="how often to look for late spans")
    spans_group: str | None = Field(default=None, description="the spans consumer's group; unset = <prefix>.spans")
    max_batch: int = Field(default=500, ge=1, le=100_000, description="rollout events handled together")

    @field_validator("agent_pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"FULMEN_TRANSITIONS_AGENT_PATTERN is not a regular expression: {exc}") from None
        return value

    @field_validator("credit")
    @classmethod
    def _registered(cls, value: str) -> str:
        try:
            credit_strategy(value)
        except ConfigurationError as exc:
            raise ValueError(f"FULMEN_TRANSITIONS_CREDIT: {exc.message}") from None
        return value


class ConsumersSettings(FulmenSettings):
    """The consumers process (``fulmen consume``): the shared sections plus ``transitions``."""

    transitions: TransitionsSection = Field(default_factory=TransitionsSection)
