"""The task file: the JSONL of tasks that ``fulmen submit`` publishes and ``fulmen train`` dispatches.

Format: UTF-8 text, one JSON object a line; blank lines are skipped. A line with an ``input`` key is a task
description with these fields (any other key is an error; a field set to ``null`` counts as absent):

* ``input`` (object, required): the task, handed to the agent unchanged;
* ``task_id`` (identifier: letters, digits, ``. _ : -``, at most 128): by default a stable id derived from
  ``input`` (``t-`` and 16 hex digits of the SHA-256 of its canonical JSON), so a file names its
  tasks the same way every time it is read;
* ``metadata`` (object of strings): copied into each request's metadata;
* ``mode`` (``train`` or ``val``), ``timeout_s`` (seconds, > 0, at most a week) and ``max_attempts``
  (1 to 100): the requests' settings; ``fulmen submit`` honours them (``--mode`` overrides ``mode``), while
  ``fulmen train`` runs every rollout with the run's own (``train`` for ``--dataset``, ``val`` for ``--val``,
  ``FULMEN_TRAIN_ROLLOUT_TIMEOUT_S``, ``FULMEN_TRAIN_MAX_ATTEMPTS``) and warns that it does.

Any other object is the input itself: ``{"question": "2+2?"}`` reads as ``{"input": {"question": "2+2?"}}``.

Every line is checked when the file is read, against :class:`~fulmen.schemas.events.RolloutRequest`, so a bad
line fails before anything is sent. :func:`load_task_file` raises
:class:`~fulmen.schemas.errors.ConfigurationError` naming ``path:line`` and what is wrong: not UTF-8, not
JSON, not an object, an unknown field, a field that is not valid (``RolloutRequest.timeout_s: ...``); and for
a missing file or one without a task.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fulmen.schemas.codec import decode_obj
from fulmen.schemas.errors import ConfigurationError, DecodeError
from fulmen.schemas.events import RolloutMode, RolloutRequest, new_id

__all__ = ["TASK_FIELDS", "TaskSpec", "load_task_file", "stable_task_id"]

TASK_FIELDS = ("input", "task_id", "metadata", "mode", "timeout_s", "max_attempts")
_OPTIONS = ("mode", "timeout_s", "max_attempts")  # request settings a line may set (None: not set)
_ID_LENGTH = 128


@dataclass(frozen=True)
class TaskSpec:
    """One task of a task file: its id, the agent's input, metadata, and the request settings the line set."""

    task_id: str
    input: dict[str, Any]
    metadata: dict[str, str] = field(default_factory=dict)
    mode: RolloutMode | None = None
    timeout_s: float | None = None
    max_attempts: int | None = None
    line: int | None = None  # where it was read (None: built in code)

    def options(self) -> dict[str, Any]:
        """The request settings the line set (``mode``, ``timeout_s``, ``max_attempts``), by name."""
        return {name: getattr(self, name) for name in _OPTIONS if getattr(self, name) is not None}

    def new_group_id(self) -> str:
        """A fresh group id for rollouts of this task: the task id and 8 random hex digits (cut to fit)."""
        return f"{self.task_id}-{new_id()[:8]}"[-_ID_LENGTH:]


def load_task_file(path: Path | str) -> list[TaskSpec]:
    """The tasks of a task file (format in the module docstring), every line checked.

    Raises :class:`ConfigurationError` naming ``path:line`` for a bad line, and for a missing or empty file.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigurationError(f"{path}: no such task file")
    tasks = []
    # bytes.splitlines splits at \n, \r and \r\n only: U+2028 inside a JSON string is not a line break here
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigurationError(f"{path}:{number}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
        if text.strip():
            tasks.append(_task_of(text, f"{path}:{number}", number))
    if not tasks:
        raise ConfigurationError(f"{path}: no tasks in the file (one JSON object a line)")
    return tasks


def stable_task_id(value: Any) -> str:
    """The id of a task that names none: the same input always gets the same id."""
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return "t-" + hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _task_of(text: str, where: str, number: int) -> TaskSpec:
    try:
        item = json.loads(text)
    except ValueError as exc:
        raise ConfigurationError(f"{where}: not JSON ({exc})") from None
    if not isinstance(item, dict):
        raise ConfigurationError(f"{where}: each line must be a JSON object")
    if "input" not in item:
        item = {"input": item}
    unknown = set(item) - set(TASK_FIELDS)
    if unknown:
        raise ConfigurationError(
            f"{where}: unknown field(s) {', '.join(sorted(unknown))}; a task line has {', '.join(TASK_FIELDS)}"
        )
    if not isinstance(item["input"], dict):
        raise ConfigurationError(f"{where}: input must be a JSON object, not {_json_type(item['input'])}")
    fields = {name: value for name, value in item.items() if value is not None}
    fields.setdefault("task_id", stable_task_id(item["input"]))
    try:  # checked now, as a request would check them, not when the task is sent
        probe = decode_obj(RolloutRequest, {**fields, "group_id": "g"})
    except DecodeError as exc:
        raise ConfigurationError(f"{where}: {exc}") from None
    options = {name: getattr(probe, name) for name in _OPTIONS if name in fields}
    return TaskSpec(probe.task_id, probe.input, dict(probe.metadata), line=number, **options)


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
