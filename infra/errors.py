"""Fulmen's exceptions, re-exported for the components (the hierarchy lives in ``schemas.errors``)."""

from schemas.errors import (
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
