"""The errors the trainer side raises: those of ``fulmen.schemas.errors``, or look-alikes where pydantic is missing.

The GPU machine that runs the torch trainer may have only torch, transformers and peft installed. Importing
``fulmen.schemas.errors`` runs ``schemas/__init__``, which imports the pydantic event models, so there it fails. The
math and trainer modules (``advantages``, ``losses``, ``batch``, ``trainer``) import their errors from here:
with pydantic installed these ARE the classes of ``fulmen.schemas.errors`` (``except ConfigurationError`` anywhere in
Fulmen catches them); without it they are small stand-ins with the same names and hierarchy::

    FulmenError
    ├── ConfigurationError    a setting or an argument is wrong; the message says what to set instead
    └── PoisonInputError      an input that will never be valid (a sample longer than max_len, ...)
"""

from __future__ import annotations

__all__ = ["ConfigurationError", "FulmenError", "PoisonInputError"]

try:
    from fulmen.schemas.errors import ConfigurationError, FulmenError, PoisonInputError
except ModuleNotFoundError as missing:  # pragma: no cover - exercised on the GPU machine only
    if (missing.name or "").split(".")[0] == "schemas":
        raise

    class FulmenError(Exception):  # type: ignore[no-redef]
        """Stand-in for ``fulmen.schemas.errors.FulmenError`` (pydantic is not installed here)."""

    class ConfigurationError(FulmenError):  # type: ignore[no-redef]
        """Stand-in for ``fulmen.schemas.errors.ConfigurationError``."""

    class PoisonInputError(FulmenError):  # type: ignore[no-redef]
        """Stand-in for ``fulmen.schemas.errors.PoisonInputError``."""
