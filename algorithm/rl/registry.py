"""A name -> function (or object) registry for the algorithm: duplicates rejected, unknown names listed.

Each family (advantage estimators, policy losses, loss aggregations) has a ``StrEnum`` of its built-in names
and one :class:`Registry`. Registering a name twice raises; so does asking for a name nobody registered, and
that error lists every valid name. Imports nothing but the errors (no torch, no pydantic).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from fulmen.schemas.errors import ConfigurationError

__all__ = ["Registry"]

F = TypeVar("F")


class Registry(Generic[F]):
    """Functions of one kind by name. ``kind`` names the family in error messages ("advantage estimator")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._functions: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: register the function under ``name`` (a ``StrEnum`` member or a plain string)."""
        key = str(name)

        def decorate(function: F) -> F:
            if key in self._functions:
                raise ConfigurationError(
                    f"{self.kind} {key!r} is already registered (by {_describe(self._functions[key])}); "
                    "pick another name"
                )
            self._functions[key] = function
            return function

        return decorate

    def get(self, name: str) -> F:
        """The function registered under ``name``; ConfigurationError listing the valid names otherwise."""
        try:
            return self._functions[str(name)]
        except KeyError:
            raise ConfigurationError(f"unknown {self.kind} {str(name)!r}; valid: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        return list(self._functions)

    def __contains__(self, name: object) -> bool:
        return str(name) in self._functions


def _describe(registered: object) -> str:
    return getattr(registered, "__qualname__", None) or type(registered).__qualname__
