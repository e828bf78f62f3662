"""Reading a tasks file: every line validated before anything is sent, errors that name line and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from fulmen.infra.errors import ConfigurationError
from fulmen.producers.submit import load_tasks, requests_for
from fulmen.schemas import RolloutMode


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text(text)
    return path


def test_plain_objects_and_task_descriptions(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '{"question": "2+2?", "answer": 4}\n\n{"task_id": "q2", "input": {"question": "3+3?"}, "timeout_s": 30}\n',
    )
    tasks = load_tasks(path)
    submission = requests_for(tasks, group_size=4, mode=RolloutMode.VAL)
    assert len(submission.requests) == 8 and len(submission.groups) == 2
    first, last = submission.requests[0], submission.requests[-1]
    assert first.input == {"question": "2+2?", "answer": 4} and first.task_id.startswith("t-")
    assert last.task_id == "q2" and last.timeout_s == 30 and last.mode is RolloutMode.VAL
    assert len({r.rollout_id for r in submission.requests}) == 8
    assert {r.group_id for r in submission.requests[:4]} == {submission.requests[0].group_id}


def test_task_ids_are_stable_across_submissions(tmp_path: Path) -> None:
    first = load_tasks(write(tmp_path, '{"b": 1, "a": 2}\n'))[0]["task_id"]
    assert load_tasks(write(tmp_path, '{"a": 2, "b": 1}\n'))[0]["task_id"] == first
    path = write(tmp_path, '{"a": 2, "b": 1}\n')
    assert requests_for(load_tasks(path), 1).groups != requests_for(load_tasks(path), 1).groups  # fresh groups


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"input": {}}\n{oops\n', "tasks.jsonl:2: not JSON"),
        ("[1, 2]\n", "tasks.jsonl:1: each line must be a JSON object"),
        ('{"input": {}, "timeout": 5}\n', "unknown field(s) timeout"),
        ('{"input": {}, "timeout_s": -1}\n', ":1: RolloutRequest.timeout_s: Input should be greater than 0"),
        ('{"input": {}, "task_id": "has space"}\n', "RolloutRequest.task_id"),
        ("\n\n", "no tasks"),
    ],
)
def test_bad_lines_are_named(tmp_path: Path, text: str, words: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigurationError, match=None) as caught:
        requests_for(load_tasks(path), 2, source=str(path))
    assert words in str(caught.value)


def test_group_size_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="at least 1"):
        requests_for(load_tasks(write(tmp_path, "{}\n")), 0)
