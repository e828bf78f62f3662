"""Where a run's checkpoints live and how many it keeps.

Each step saves the new model version as ``<run_dir>/checkpoints/v<N>`` (a Hugging Face directory, or per-agent
adapters), and the published ``ModelVersion`` names that path: gateways load it from there. With full weights
every version is the whole model (SmolLM2-135M: about 540 MB, so 20 steps are 11 GB), so a run may keep only
the latest ``keep_checkpoints`` of them (``FULMEN_TRAIN_KEEP_CHECKPOINTS``; 0, the default, keeps every one, as
Hugging Face's ``save_total_limit`` does). Never removed: the newest ``keep`` versions (the latest holds the
optimizer state a resume needs; the one before may still be loading in a gateway that lags, hence at least 2),
and the version a promotion gate serves (gateways that follow promotions load it).

With ``checkpoint_uri`` (``FULMEN_TRAIN_CHECKPOINT_URI=s3://bucket/prefix``) each version is also uploaded to the
object store (:mod:`fulmen.infra.objectstore`) before it is published, and published there: the model as
``<prefix>/<run_id>/v<N>`` (what gateways on other machines fetch), the optimizer state apart as
``<prefix>/<run_id>/state/v<N>`` (only the latest kept, as on disk: a gateway never downloads it). A run started
again on a machine with no checkpoint of its own resumes from the latest version that has both
(:func:`restore_from_store`).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fulmen.algorithm.trainer.base import TEMPORARY_MARK, TRAINING_STATE
from fulmen.infra.objectstore import (
    delete_checkpoint,
    download_dir,
    join_uri,
    list_checkpoints,
    read_manifest,
    upload_dir,
)
from fulmen.schemas.events import ModelVersion

if TYPE_CHECKING:
    from fulmen.algorithm.settings import TrainSection

__all__ = [
    "checkpoint_dir",
    "model_in_store",
    "prune_checkpoints",
    "published_uri",
    "restore_from_store",
    "version_events",
]

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
            # renamed first: a kill midway leaves a `.tmp-<pid>-old` folder (removed by the next run, never a
            # half-removed `v<K>` that an export would try to load)
            doomed = path.with_name(f"{path.name}{TEMPORARY_MARK}{os.getpid()}-old")
            path.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(version)
    if removed:
        log.info("removed the checkpoints of version(s) %s (keep_checkpoints=%d)", sorted(removed), keep)
    return sorted(removed)


def published_uri(path: Path, run_id: str, checkpoint_uri: str) -> str:
    """Where the checkpoint saved at ``path`` (``.../v<N>``) is published: ``path`` itself, or with
    ``checkpoint_uri`` its upload (the optimizer state first, then the model; the version before's state removed
    from the store once this one's is there)."""
    if not checkpoint_uri:
        return str(path)
    model = join_uri(checkpoint_uri, run_id, path.name)
    if (path / TRAINING_STATE).is_file():
        upload_dir(
            path, _state_uri(checkpoint_uri, run_id, path.name), only=lambda relative: relative == TRAINING_STATE
        )
    upload_dir(path, model, only=lambda relative: relative != TRAINING_STATE)
    version = int(path.name[1:])
    if version > 0 and (path / TRAINING_STATE).is_file():
        delete_checkpoint(_state_uri(checkpoint_uri, run_id, f"v{version - 1}"))
    return model


def restore_from_store(run_dir: Path, run_id: str, checkpoint_uri: str) -> int | None:
    """Copy the latest version of ``run_id`` in the store, with its optimizer state when the store has it (a run
    of several ranks saves none: its optimizer starts afresh, as on a local resume), into
    ``<run_dir>/checkpoints/v<N>`` (whole or not at all); its number, or None when the store has none."""
    models = list_checkpoints(join_uri(checkpoint_uri, run_id))
    if not models:
        return None
    version = max(models)
    states = list_checkpoints(join_uri(checkpoint_uri, run_id, "state"))
    cache = run_dir / "store-cache"
    target = checkpoint_dir(run_dir, version)
    staging = target.with_name(f"{target.name}{TEMPORARY_MARK}{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(download_dir(models[version], cache), staging)
    if version in states:
        shutil.copy2(download_dir(states[version], cache) / TRAINING_STATE, staging / TRAINING_STATE)
    staging.rename(target)
    shutil.rmtree(cache, ignore_errors=True)
    log.info("restored version %d of run %s from %s into %s", version, run_id, models[version], target)
    return version


def model_in_store(path: Path, run_id: str, checkpoint_uri: str) -> str:
    """Where the model at ``path`` is in the object store, for the ranks of a job on other machines than rank 0's:
    a version of the run (``.../checkpoints/v<N>``) at its published URI, any other directory (the base model) at
    ``<run>/base``; uploaded (without optimizer state) when the store does not have it yet."""
    name = path.name if path.parent.name == "checkpoints" and path.name[1:].isdigit() else "base"
    uri = join_uri(checkpoint_uri, run_id, name)
    if read_manifest(uri) is None:
        upload_dir(path, uri, only=lambda relative: relative != TRAINING_STATE)
    return uri


def _state_uri(checkpoint_uri: str, run_id: str, name: str) -> str:
    return join_uri(checkpoint_uri, run_id, "state", name)


def version_events(
    options: TrainSection, base_model: str, agents: Sequence[str] | None, uri: str, version: int
) -> list[ModelVersion]:
    """What a checkpoint published at ``uri`` announces: the model, or (per-agent adapters) one event per agent's
    adapter (``<uri>/<agent>``)."""
    adapters = [(join_uri(uri, agent), agent) for agent in agents or ()] or [(uri, "")]
    return [
        ModelVersion(
            model_name=options.model_name,
            version=version,
            uri=where,
            format="hf_lora_adapter" if agent else "hf",
            adapter=agent,
            base_model=base_model,
            run_id=options.run_id,
            step=version,
        )
        for where, agent in adapters
    ]
