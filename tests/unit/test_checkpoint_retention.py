"""``keep_checkpoints``: a run keeps only its newest N versions' checkpoints and the version a promotion gate
serves; 0 keeps every one; 1 is refused (a lagging gateway may still load the version before the latest)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from fulmen.algorithm.service.checkpoints import checkpoint_dir, prune_checkpoints
from fulmen.algorithm.settings import TrainSection


def versions(run_dir: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in (run_dir / "checkpoints").glob("v*") if p.name[1:].isdigit())


def test_the_newest_n_and_the_serving_version_stay(tmp_path: Path) -> None:
    for version in range(1, 7):
        checkpoint_dir(tmp_path, version).mkdir(parents=True)
        (checkpoint_dir(tmp_path, version) / "config.json").write_text("{}")
    (tmp_path / "checkpoints" / "v7.tmp-1").mkdir()  # a save in progress is not a version
    assert prune_checkpoints(tmp_path, 6, 0) == [] and versions(tmp_path) == [1, 2, 3, 4, 5, 6]
    assert prune_checkpoints(tmp_path, 6, 3, protected={2}) == [1, 3]
    assert [p.name for p in sorted((tmp_path / "checkpoints").iterdir())] == ["v2", "v4", "v5", "v6", "v7.tmp-1"]


def test_a_version_being_removed_is_never_a_half_removed_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for version in (1, 2, 3):
        checkpoint_dir(tmp_path, version).mkdir(parents=True)
        (checkpoint_dir(tmp_path, version) / "config.json").write_text("{}")
    removing = []
    monkeypatch.setattr("shutil.rmtree", lambda path, ignore_errors=False: removing.append(Path(path).name))  # killed
    assert prune_checkpoints(tmp_path, 3, 2) == [1]
    assert removing == [f"v1.tmp-{os.getpid()}-old"] and versions(tmp_path) == [2, 3]  # v1 is gone as a version


def test_keep_checkpoints_is_a_setting_that_refuses_one() -> None:
    assert TrainSection().keep_checkpoints == 0 and TrainSection(keep_checkpoints=2).keep_checkpoints == 2
    with pytest.raises(ValidationError, match="use 2 or more"):
        TrainSection(keep_checkpoints=1)
