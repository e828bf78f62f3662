"""Settings of the transitions consumer (``FULMEN_TRANSITIONS_*``)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

__all__ = ["TransitionsSection"]


class TransitionsSection(BaseModel):
    """``FULMEN_TRANSITIONS_AGENT_PATTERN``, ``FULMEN_TRANSITIONS_LATE_WINDOW_S``... Credit assignment is not here:
    the run that trains chooses it (``FULMEN_TRAIN_CREDIT``, ``FULMEN_TRAIN_GAMMA``)."""

    agent_pattern: str | None = Field(
        default=None,
        description="train only the calls of agents whose name matches this regex as a whole; unset = all calls",
    )
    barrier_timeout_s: float = Field(
        default=30.0, gt=0, description="warn when the spans consumer has not caught up by then (then keep waiting)"
    )
    late_window_s: float = Field(
        default=60.0,
        ge=0,
        le=24 * 3600,
        description="how long after its build a rollout is watched for late spans (rebuilt if any); 0 = never",
    )
    late_check_interval_s: float = Field(
        default=5.0, gt=0, description="how often to look for late spans (each look reads the store)"
    )
    build_interval_s: float = Field(
        default=2.0,
        ge=0,
        le=60,
        description="at most one build (one read of the finished rollouts' spans from the store) this often: under "
        "load a build takes every rollout released meanwhile, and a read costs about the same for 50 rollouts or "
        "500; a build after a quiet spell goes at once; 0 = build whatever is released at once",
    )
    from_stream: bool = Field(
        default=True,
        description="build a finished rollout from the spans this process's spans consumer stored (the span feed) "
        "when it saw them all; false = always read them back from the store",
    )
    feed_max_mb: int = Field(
        default=64, ge=1, le=65_536, description="spans the feed holds for running rollouts (past it: read back)"
    )
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

    @model_validator(mode="before")
    @classmethod
    def _credit_moved(cls, data: Any) -> Any:
        moved = [
            f"FULMEN_TRANSITIONS_{name.upper()}"
            for name in ("credit", "gamma")
            if isinstance(data, dict) and name in data
        ]
        if moved:
            raise ValueError(
                f"{' and '.join(moved)}: credit assignment is chosen by the run that trains now; set "
                "FULMEN_TRAIN_CREDIT / FULMEN_TRAIN_GAMMA for `fulmen train` instead"
            )
        return data
