"""Settings of the feedback consumer (``FULMEN_FEEDBACK_*``), a section of the consumers process's settings."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

__all__ = ["FeedbackSection"]


class FeedbackSection(BaseModel):
    """``FULMEN_FEEDBACK_RESOLVE_GRACE_S``, ``FULMEN_FEEDBACK_RETRY_FIRST_S``... (see each field)."""

    resolve_grace_s: float = Field(
        default=30.0,
        ge=0,
        le=7 * 24 * 3600,
        description="how long after it was sent a feedback's target may still be missing from the store (its spans on "
        "their way); then, once the spans and rollouts consumers have stored what was published by then, it is "
        "dead-lettered",
    )
    retry_first_s: float = Field(
        default=0.25, gt=0, description="the first wait before looking again for a target not found (doubled each time)"
    )
    retry_max_s: float = Field(default=5.0, gt=0, description="the longest wait between two looks for one target")
    max_pending: int = Field(
        default=10_000, ge=1, le=1_000_000, description="feedback waiting for its target; at this many, fetching pauses"
    )
    max_batch: int = Field(default=500, ge=1, le=100_000, description="feedback records fetched in one poll")

    @model_validator(mode="after")
    def _retries_ordered(self) -> FeedbackSection:
        if self.retry_max_s < self.retry_first_s:
            raise ValueError(
                f"FULMEN_FEEDBACK_RETRY_MAX_S ({self.retry_max_s:g}) is below FULMEN_FEEDBACK_RETRY_FIRST_S "
                f"({self.retry_first_s:g}): raise it, or lower the first wait"
            )
        return self
