"""Settings of the consumers process (``fulmen consume``): the shared sections plus each worker's own."""

from __future__ import annotations

from pydantic import Field

from fulmen.consumers.feedback.settings import FeedbackSection
from fulmen.consumers.production.settings import ProductionSection
from fulmen.consumers.transitions.settings import TransitionsSection
from fulmen.infra.settings import FulmenSettings

__all__ = ["ConsumersSettings"]


class ConsumersSettings(FulmenSettings):
    """The consumers process (``fulmen consume``): the shared sections plus ``transitions``, ``feedback`` and
    ``production``."""

    transitions: TransitionsSection = Field(default_factory=TransitionsSection)
    feedback: FeedbackSection = Field(default_factory=FeedbackSection)
    production: ProductionSection = Field(default_factory=ProductionSection)
