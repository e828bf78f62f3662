"""Where a run's checkpoints live and how many it keeps.

Each step saves the new model version as ``<run_dir>/checkpoints/v<N>`` (a Hugging Face directory, or per-agent
adapters), and the published ``ModelVersion`` names that path: gateways load it from there. With full weights
every version is the whole model (SmolLM2-135M: about 540 MB, so 20 steps are 11 GB), so a run may keep only
the latest ``keep_checkpoints`` of them (``FULMEN_TRAIN_KEEP_CHECKPOINTS``; 0, the default, keeps every one, as
Hugging Face's ``save_total_limit`` does). Never removed: the newest ``keep`` versions (the latest holds the
optimizer state a resume needs; the one before may still be loading in a gateway that lags, hence at least 2),
and the version a promotion gate serves (gateways that follow promotions load it).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from pathlib import Path

__all__ = ["checkpoint_dir", "prune_checkpoints"]

log = logging.getLogger(__name__)


def checkpoint_dir(run_dir: Path, version: int) -> Path:
    return run_dir / "checkpoints" / f"v{version}"


def prune_checkpoints(run_dir: Path, latest: int, keep: int, protected: Iterable[int] = ()) -> list[int]:
    """Remove the checkpoints of versions up to ``latest - keep`` (none when ``keep`` is 0) except ``protected``;
    the versions removed."""
    if keep <= 0:
        return []
    spared = set(protected)
    removed = []
    for path in sorted((run_dir / "checkpoints").glob("v*")):
        version = int(path.name[1:]) if path.name[1:].isdigit() else None
        if version is not None and version <= latest - keep and version not in spared:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(version)
    if removed:
        log.info("removed the checkpoints of version(s) %s (keep_checkpoints=%d)", sorted(removed), keep)
    return sorted(removed)
