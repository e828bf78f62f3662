"""Settings of the production episode detector (``FULMEN_PRODUCTION_*``), a section of the consumers process's."""

from __future__ import annotations

from pydantic import BaseModel, Field

__all__ = ["ProductionSection"]


class ProductionSection(BaseModel):
    """``FULMEN_PRODUCTION_ENABLED``, ``FULMEN_PRODUCTION_IDLE_S``... (see each field)."""

    enabled: bool = Field(
        default=True, description="group the calls of agents Fulmen does not run into production rollouts, by trace"
    )
    idle_s: float = Field(
        default=60.0,
        gt=0,
        le=24 * 3600,
        description="a trace's episode ends when no new span of it has arrived for this long",
    )
    max_open: int = Field(
        default=100_000, ge=1, le=10_000_000, description="traces open at once; at this many, fetching pauses"
    )
    max_batch: int = Field(default=2000, ge=1, le=100_000, description="span records fetched in one poll")
