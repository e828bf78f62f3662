"""The task file: one format for `fulmen submit` and `fulmen train`, every line checked, errors naming the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import RolloutMode
from fulmen.schemas.task_file import TASK_FIELDS, TaskSpec, load_task_file, stable_task_id


def write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def test_a_line_is_a_task_description_or_the_input_itself(tmp_path: Path) -> None:
    described = {
        "input": {"q": 2},
        "task_id": "two",
        "metadata": {"k": "v"},
        "mode": "val",
        "timeout_s": 30,
        "max_attempts": 5,
    }
    text = json.dumps({"q": 1}) + "\n\n  \n" + json.dumps(described) + "\r\n" + '{"input": {"q": "a\u2028b"}}'
    first, second, third = load_task_file(write(tmp_path, text))
    assert first == TaskSpec(stable_task_id({"q": 1}), {"q": 1}, line=1) and first.options() == {}
    assert second == TaskSpec("two", {"q": 2}, {"k": "v"}, RolloutMode.VAL, 30.0, 5, line=4)
    assert second.options() == {"mode": RolloutMode.VAL, "timeout_s": 30.0, "max_attempts": 5}
    assert third.input == {"q": "a\u2028b"} and third.line == 5  # U+2028 in a string does not end the line
    assert set(TASK_FIELDS) == {"input", "task_id", "metadata", "mode", "timeout_s", "max_attempts"}


def test_ids_are_stable_and_null_fields_count_as_absent(tmp_path: Path) -> None:
    one = load_task_file(write(tmp_path, '{"b": 1, "a": 2}\n'))[0]
    other = load_task_file(write(tmp_path, '{"input": {"a": 2, "b": 1}, "task_id": null, "metadata": null}\n'))[0]
    assert one.task_id == other.task_id and one.task_id.startswith("t-") and other.metadata == {}


def test_group_ids_are_fresh_and_fit_an_identifier() -> None:
    task = TaskSpec("x" * 128, {})
    first, second = task.new_group_id(), task.new_group_id()
    assert first != second and len(first) == 128


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"input": {}}\n{oops\n', "tasks.jsonl:2: not JSON"),
        (b'{"input": {}}\n{"q": "\xff"}\n', "tasks.jsonl:2: not UTF-8"),
        ("[1, 2]\n", "tasks.jsonl:1: each line must be a JSON object"),
        ('"text"\n', "tasks.jsonl:1: each line must be a JSON object"),
        ('{"input": {}, "timeout": 5}\n', "tasks.jsonl:1: unknown field(s) timeout; a task line has input, task_id"),
        ('{"input": [1]}\n', "tasks.jsonl:1: input must be a JSON object, not an array"),
        ('{"input": {}, "timeout_s": -1}\n', "tasks.jsonl:1: RolloutRequest.timeout_s: Input should be greater than 0"),
        ('{"input": {}, "max_attempts": 0}\n', "tasks.jsonl:1: RolloutRequest.max_attempts"),
        ('{"input": {}, "mode": "test"}\n', "tasks.jsonl:1: RolloutRequest.mode"),
        ('{"input": {}, "task_id": "has space"}\n', "tasks.jsonl:1: RolloutRequest.task_id"),
        ('{"input": {}, "metadata": {"n": 1}}\n', "tasks.jsonl:1: RolloutRequest.metadata.n"),
    ],
)
def test_a_bad_line_is_named(tmp_path: Path, text: str | bytes, words: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        load_task_file(write(tmp_path, text))
    assert words in str(caught.value)


@pytest.mark.parametrize("text", ["", "\n\n   \n"])
def test_a_file_without_tasks_is_refused(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigurationError, match="no tasks in the file"):
        load_task_file(write(tmp_path, text))


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="no such task file"):
        load_task_file(tmp_path / "nowhere.jsonl")
    with pytest.raises(ConfigurationError, match="no such task file"):
        load_task_file(tmp_path)  # a directory
