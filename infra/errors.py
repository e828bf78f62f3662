"""Fulmen's exceptions, re-exported for the components (the hierarchy lives in ``fulmen.schemas.errors``)."""

from fulmen.schemas.errors import (
    BrokerUnavailableError,
    ConfigurationError,
    DecodeError,
    FulmenError,
    PoisonInputError,
    RetryableError,
)

__all__ = [
    "BrokerUnavailableError",
    "ConfigurationError",
    "DecodeError",
    "FulmenError",
    "PoisonInputError",
    "RetryableError",
]
