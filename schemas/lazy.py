"""Names a package exports from its modules, imported on first use (PEP 562), so importing the package is cheap.

    __getattr__, __dir__ = lazy_exports(globals(), {"Runner": "fulmen.producers.runner.app"})

``fulmen``, ``fulmen.schemas`` and the producers' packages export this way: ``fulmen.schemas.errors`` loads
without pydantic, and the CLI reads the producers' settings without importing their servers.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    namespace: dict[str, Any], homes: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of the package whose ``globals()`` is ``namespace``: a name of
    ``homes`` is imported from its module on first use (then kept in ``namespace``); any other is an
    AttributeError."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace.get("__all__", ())})

    return __getattr__, __dir__
