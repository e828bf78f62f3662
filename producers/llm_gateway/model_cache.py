"""Model versions published with an object-store URI (``s3://...``: a trainer that does not share this machine's
disk, ``FULMEN_TRAIN_CHECKPOINT_URI``) are fetched into ``$FULMEN_HOME/model-cache`` before the backend loads them
(:func:`fulmen.infra.objectstore.download_dir`: every file checked against the checkpoint's manifest, renamed into
place whole, fetched once per version and reused by a restart). A version with a local path is loaded as it is.
"""

from __future__ import annotations

import time
from pathlib import Path

from fulmen.infra.objectstore import download_dir, is_object_uri
from fulmen.schemas import ModelVersion

__all__ = ["local_version"]


def local_version(event: ModelVersion, cache: Path) -> tuple[ModelVersion, float]:
    """``event`` with its ``uri`` and ``base_model`` on this machine (fetched when they name an object store), and
    the seconds the fetch took (0 when there was nothing to fetch)."""
    started = time.monotonic()
    changes = {
        field: str(download_dir(value, cache))
        for field in ("uri", "base_model")
        if (value := getattr(event, field)) and is_object_uri(value)
    }
    if not changes:
        return event, 0.0
    return event.model_copy(update=changes), time.monotonic() - started
