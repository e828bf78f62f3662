"""``--model tiny`` for the gateway: the tiny offline model, built once into a cache directory under FULMEN_HOME.

The builder is passed in (the CLI passes ``fulmen.algorithm.tiny_model.build_tiny_model``: producers never import the
algorithm). It is deterministic (fixed seed), so the gateway's tiny model has the same weights as the base
model ``fulmen train --model tiny`` builds in its run directory.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["TINY", "build_once", "tiny_model_dir"]

log = logging.getLogger(__name__)

TINY = "tiny"


def tiny_model_dir(home: Path) -> Path:
    """Where the gateway keeps its tiny model."""
    return home / "models" / TINY


def build_once(directory: Path, build: Callable[[Path], object]) -> Path:
    """``directory`` holding a built model: built by ``build`` into a temporary sibling and renamed into place,
    so a process that starts meanwhile never loads half a model; an existing build is reused."""
    if (directory / "config.json").is_file():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        build(staging)
        try:
            os.rename(staging, directory)
        except OSError:  # another process finished first (the directory exists now): use its build
            if not (directory / "config.json").is_file():
                raise
        else:
            log.info("built the tiny model into %s", directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory
