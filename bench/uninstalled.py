"""Fulmen imported from this checkout without its install (the lent GPU machine has none): the package ``fulmen``
with the repository's top-level folders as its subpackages, as ``pyproject.toml`` maps them.

    sys.path.insert(0, str(ROOT / "bench")); from uninstalled import map_fulmen; map_fulmen(ROOT)

The package is built with both folders on its path before its ``__init__`` runs, since that imports
``fulmen.schemas`` (appending the root to ``fulmen.__path__`` after ``import fulmen`` is too late).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

__all__ = ["map_fulmen"]


def map_fulmen(root: Path | str) -> None:
    """Make ``import fulmen.<folder>`` load ``root/<folder>`` (idempotent; an installed Fulmen is the same files)."""
    root = str(root)
    if root not in sys.path:
        sys.path.insert(0, root)
    loaded = sys.modules.get("fulmen")
    if loaded is not None:
        if root not in loaded.__path__:
            loaded.__path__.append(root)
        return
    spec = importlib.util.spec_from_file_location(
        "fulmen", f"{root}/fulmen/__init__.py", submodule_search_locations=[f"{root}/fulmen", root]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["fulmen"] = module
    spec.loader.exec_module(module)
