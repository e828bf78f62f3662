"""`fulmen init NAME`: the scaffold is refused over a non-empty directory, its teacher check passes, and the
scaffold trains UNCHANGED for one step on the tiny model through the whole system, with the command its README
gives (`fulmen train --local ...` run in the project's directory; Kafka is the session's broker; only the held-out
file is cut to 8 tasks, so validating twice stays short); `python tasks.py` writes the task files it ships."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fulmen.cli.init import FILES, scaffold
from fulmen.infra.kafka.local import LocalKafka
from fulmen.schemas.errors import ConfigurationError

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

FULMEN = [sys.executable, "-m", "fulmen.cli.main"]


def test_init_refuses_a_directory_that_is_not_empty(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(ConfigurationError, match="exists and is not empty"):
        scaffold(tmp_path)
    assert (tmp_path / "mine.txt").read_text() == "keep me" and not (tmp_path / "agent.py").exists()
    done = subprocess.run([*FULMEN, "init", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode != 0 and "not empty" in done.stderr + done.stdout


def test_the_scaffold_trains_one_step_unchanged(kafka_broker: LocalKafka, tiny_model: Path, tmp_path: Path) -> None:
    project = tmp_path / "my_agent"
    done = subprocess.run([*FULMEN, "init", str(project)], capture_output=True, text=True, check=True)
    assert sorted(p.name for p in project.iterdir()) == sorted(FILES), done.stdout
    readme = (project / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.startswith("fulmen train"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")}
    env |= {
        "FULMEN_KAFKA_BOOTSTRAP": kafka_broker.bootstrap,
        "FULMEN_HOME": str(tmp_path / "home"),
        "FULMEN_TRAIN_DEVICE": "cpu",
        "FULMEN_TRAIN_GROUP_SIZE": "2",
        "FULMEN_TRAIN_GROUPS_PER_STEP": "2",
        "FULMEN_TRAIN_VAL_GROUP_SIZE": "1",
    }
    checked = subprocess.run([sys.executable, "teacher.py"], cwd=project, capture_output=True, text=True, env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert json.loads(checked.stdout.splitlines()[-1])["rewarded"] == 320
    val = (project / "val.jsonl").read_text().splitlines()
    (project / "val.jsonl").write_text("\n".join(val[:8]) + "\n")  # 8 of the 200 held-out tasks: a short test
    args = command.split()[1:]
    args[args.index("tiny")] = str(tiny_model)  # the session's tiny model (the README's `tiny` builds the same)
    trained = subprocess.run([*FULMEN, *args], cwd=project, capture_output=True, text=True, env=env, timeout=840)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert "v1" in trained.stdout + trained.stderr


def test_tasks_py_writes_the_shipped_task_files_with_no_question_in_both(tmp_path: Path) -> None:
    project = tmp_path / "my_agent"
    scaffold(project)
    shipped = {name: (project / name).read_text() for name in ("train.jsonl", "val.jsonl")}
    done = subprocess.run([sys.executable, "tasks.py"], cwd=project, capture_output=True, text=True, check=True)
    assert "wrote 320 tasks to train.jsonl" in done.stdout
    assert {name: (project / name).read_text() for name in shipped} == shipped  # the same seed, the same files
    questions = {name: {json.loads(line)["question"] for line in text.splitlines()} for name, text in shipped.items()}
    assert len(questions["train.jsonl"]) == 320 and len(questions["val.jsonl"]) == 200
    assert not questions["train.jsonl"] & questions["val.jsonl"]
