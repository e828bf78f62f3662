"""The exception hierarchy every Fulmen component raises.

It lives in ``schemas`` because the contracts raise it (a record that fails to decode is poison input) and
``schemas`` imports nothing of ours; ``fulmen.schemas.errors`` re-exports it for everyone else::

    FulmenError                      root: catch this to catch everything Fulmen raises on purpose
    ├── ConfigurationError           fix a setting or install something, then start again
    ├── RetryableError               I/O that may succeed later (broker down, store busy)
    │   └── BrokerUnavailableError   no Kafka broker answered within the timeout
    └── PoisonInputError             this input will never be valid; reject it or dead-letter it
        └── DecodeError              bytes that do not decode into the contract they claim to carry

Errors carry the Kafka coordinates (topic, partition, offset) or the rollout id when they have them, so a log
line or a dead-letter header can point at the exact record.
"""

from __future__ import annotations

__all__ = [
    "BrokerUnavailableError",
    "ConfigurationError",
    "DecodeError",
    "FulmenError",
    "PoisonInputError",
    "RetryableError",
]


class FulmenError(Exception):
    """Root of every error Fulmen raises on purpose."""

    def __init__(
        self,
        message: str,
        *,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
        rollout_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.rollout_id = rollout_id

    def where(self) -> str:
        """The record coordinates as text (empty when the error has none)."""
        parts = []
        if self.topic is not None:
            parts.append(f"topic={self.topic}")
        if self.partition is not None:
            parts.append(f"partition={self.partition}")
        if self.offset is not None:
            parts.append(f"offset={self.offset}")
        if self.rollout_id is not None:
            parts.append(f"rollout_id={self.rollout_id}")
        return " ".join(parts)

    def __str__(self) -> str:
        where = self.where()
        return f"{self.message} [{where}]" if where else self.message


class ConfigurationError(FulmenError):
    """A setting is wrong or something required is missing; the message says what to change."""


class RetryableError(FulmenError):
    """An I/O failure that may go away: retry with backoff, or answer 503."""


class BrokerUnavailableError(RetryableError):
    """No Kafka broker answered at the configured bootstrap address within the timeout."""


class PoisonInputError(FulmenError):
    """Input that will never become valid, however often it is retried."""


class DecodeError(PoisonInputError):
    """Bytes that do not decode into the contract they claim to carry; ``field`` names the culprit."""

    def __init__(self, message: str, *, field: str | None = None, **where: object) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.field = field
