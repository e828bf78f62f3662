"""`fulmen submit`: the tasks of a task file become groups of rollout requests (the file format: test_task_file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fulmen.producers.submit import requests_for
from fulmen.schemas import RolloutMode
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.task_file import load_task_file


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text(text)
    return path


def test_plain_objects_and_task_descriptions(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '{"question": "2+2?", "answer": 4}\n\n{"task_id": "q2", "input": {"question": "3+3?"}, "timeout_s": 30, '
        '"max_attempts": 5, "mode": "train", "metadata": {"k": "v"}}\n',
    )
    submission = requests_for(load_task_file(path), group_size=4, mode=RolloutMode.VAL)
    assert len(submission.requests) == 8 and len(submission.groups) == 2
    first, last = submission.requests[0], submission.requests[-1]
    assert first.input == {"question": "2+2?", "answer": 4} and first.task_id.startswith("t-")
    assert first.timeout_s == 600 and first.max_attempts == 3  # the request's defaults
    assert (last.task_id, last.timeout_s, last.max_attempts, last.metadata) == ("q2", 30, 5, {"k": "v"})
    assert last.mode is RolloutMode.VAL  # --mode overrides the line's mode
    assert len({r.rollout_id for r in submission.requests}) == 8
    assert {r.group_id for r in submission.requests[:4]} == {submission.requests[0].group_id}


def test_the_lines_mode_holds_without_an_override(tmp_path: Path) -> None:
    path = write(tmp_path, '{"input": {}, "mode": "val"}\n{"input": {"n": 1}}\n')
    assert [r.mode for r in requests_for(load_task_file(path), 1).requests] == [RolloutMode.VAL, RolloutMode.TRAIN]


def test_each_submission_gets_fresh_groups(tmp_path: Path) -> None:
    tasks = load_task_file(write(tmp_path, '{"a": 2, "b": 1}\n'))
    assert requests_for(tasks, 1).groups != requests_for(tasks, 1).groups


def test_a_bad_line_fails_before_any_request_is_built(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"tasks.jsonl:2: RolloutRequest.timeout_s"):
        load_task_file(write(tmp_path, '{"input": {}}\n{"input": {}, "timeout_s": -1}\n'))


def test_group_size_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="at least 1"):
        requests_for(load_task_file(write(tmp_path, "{}\n")), 0)


def test_production_is_recorded_never_submitted(tmp_path: Path) -> None:
    tasks = load_task_file(write(tmp_path, '{"a": 1}\n'))
    with pytest.raises(ConfigurationError, match="--mode production: such rollouts are recorded"):
        requests_for(tasks, 1, mode=RolloutMode.PRODUCTION)
    with pytest.raises(ConfigurationError, match="production rollouts are recorded from agents Fulmen does not run"):
        load_task_file(write(tmp_path, '{"input": {}, "mode": "production"}\n'))
