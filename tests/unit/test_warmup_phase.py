"""The warm-up as a phase of ``fulmen train`` / ``fulmen.train``: the scaffold's own agent and teacher
(``fulmen init``) demonstrated and taught to the tiny model before RL, cached by recipe; clear refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fulmen.algorithm.settings import TrainSection
from fulmen.algorithm.tiny_model import build_tiny_model
from fulmen.cli.init import scaffold
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.task_file import load_task_file
from fulmen.warmup import MARKER, warmed_model


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh ``fulmen init`` project, the working directory (as the README runs its commands)."""
    scaffold(tmp_path / "agent_project")
    monkeypatch.chdir(tmp_path / "agent_project")
    monkeypatch.setattr(sys, "path", list(sys.path))  # warmed_model puts the working directory on it
    for name in ("agent", "reward", "teacher"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path / "agent_project"


def test_the_scaffolds_teacher_warms_the_model_up_once(project: Path, tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny")
    fields = TrainSection(warmup_teacher="teacher:teach", warmup_steps=3, warmup_tasks=4).model_dump()
    tasks = load_task_file(project / "train.jsonl")
    said: list[str] = []
    warmed = warmed_model(fields, "agent:run", model, tasks, tmp_path / "home", said.append)
    recipe = json.loads((warmed / MARKER).read_text())
    assert (recipe["episodes"], recipe["updates"]) == (4, 3)  # every demonstrated episode earned its reward
    assert warmed.parent.parent == tmp_path / "home" / "warmups" and (warmed / "config.json").is_file()
    assert "3 supervised steps on teacher:teach's demonstrations of 4 training tasks" in said[0]
    assert warmed_model(fields, "agent:run", model, tasks, tmp_path / "home") == warmed  # cached: reused


def test_no_teacher_no_warm_up_and_what_is_missing_is_said(project: Path, tmp_path: Path) -> None:
    model = tmp_path / "any-model"
    tasks = load_task_file(project / "train.jsonl")
    assert warmed_model(TrainSection().model_dump(), "agent:run", model, tasks, tmp_path) == model
    fields = TrainSection(warmup_teacher="teacher:teach").model_dump()
    with pytest.raises(ConfigurationError, match="pass --agent"):
        warmed_model(fields, "", model, tasks, tmp_path)
    with pytest.raises(ConfigurationError, match="give a dataset"):
        warmed_model(fields, "agent:run", model, [], tmp_path)
    with pytest.raises(ConfigurationError, match="cannot import the agent module 'nowhere'"):
        warmed_model(TrainSection(warmup_teacher="nowhere:teach").model_dump(), "agent:run", model, tasks, tmp_path)


def test_the_warm_up_settings_are_options_of_fulmen_train() -> None:
    from typer.testing import CliRunner

    from fulmen.cli.main import app

    text = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output
    for option in ("--warmup-teacher", "--warmup-steps", "--warmup-tasks", "--warmup-lr"):
        assert option in text
