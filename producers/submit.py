"""``fulmen submit``: tasks from a JSONL file become RolloutRequests on the tasks topic.

Each line is a JSON object. A line with an ``input`` key is a task description (``input`` plus optional
``task_id``, ``mode``, ``timeout_s``, ``max_attempts``, ``metadata``); any other object is the input itself.
A task without ``task_id`` gets a stable one derived from its content, so resubmitting a file names its tasks
the same way. Every task becomes ``group_size`` rollouts sharing a fresh ``group_id`` (GRPO compares them).

The whole file is validated before anything is published, so a bad line never leaves half a submission; each
request is announced as ``queued`` on the rollouts topic once the tasks topic has acknowledged it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fulmen.infra.errors import ConfigurationError, DecodeError
from fulmen.infra.kafka.publish import EventPublisher
from fulmen.schemas.codec import decode_obj
from fulmen.schemas.events import RolloutEvent, RolloutMode, RolloutRequest, RolloutStatus, new_id
from fulmen.schemas.topics import TopicKey

__all__ = ["Submission", "load_tasks", "publish", "requests_for"]

_TASK_FIELDS = {"task_id", "input", "mode", "timeout_s", "max_attempts", "metadata"}


@dataclass(frozen=True)
class Submission:
    requests: list[RolloutRequest]

    @property
    def groups(self) -> list[str]:
        return sorted({r.group_id for r in self.requests})


def load_tasks(path: Path) -> list[dict[str, Any]]:
    """The task descriptions of a JSONL file; errors name the line and the field."""
    if not path.exists():
        raise ConfigurationError(f"{path}: no such file")
    tasks = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise ConfigurationError(f"{path}:{number}: not JSON ({exc})") from None
        if not isinstance(item, dict):
            raise ConfigurationError(f"{path}:{number}: each line must be a JSON object")
        task = dict(item) if "input" in item else {"input": item}
        unknown = set(task) - _TASK_FIELDS
        if unknown:
            raise ConfigurationError(f"{path}:{number}: unknown field(s) {', '.join(sorted(unknown))}; "
                                     f"a task has {', '.join(sorted(_TASK_FIELDS))}")  # fmt: skip
        task.setdefault("task_id", _stable_id(task["input"]))
        task["_line"] = number
        tasks.append(task)
    if not tasks:
        raise ConfigurationError(f"{path}: no tasks in the file")
    return tasks


def requests_for(tasks: Iterable[dict[str, Any]], group_size: int, *, mode: RolloutMode | None = None,
                 source: str = "tasks") -> Submission:  # fmt: skip
    """``group_size`` RolloutRequests per task, validated (DecodeError names the line and the field)."""
    if group_size < 1:
        raise ConfigurationError("--group-size must be at least 1")
    requests = []
    for task in tasks:
        fields = {k: v for k, v in task.items() if k != "_line"}
        if mode is not None:
            fields["mode"] = mode
        group_id = f"{fields['task_id']}-{new_id()[:8]}"
        for _ in range(group_size):
            try:
                requests.append(decode_obj(RolloutRequest, {**fields, "group_id": group_id}))
            except DecodeError as exc:
                raise ConfigurationError(f"{source}:{task.get('_line', '?')}: {exc}") from None
    return Submission(requests)


async def publish(publisher: EventPublisher, submission: Submission, runner_id: str = "fulmen submit") -> None:
    """Publish the requests, then announce each as queued (only once the tasks topic acknowledged it)."""
    await publisher.publish_many(TopicKey.TASKS, submission.requests)
    queued = [
        RolloutEvent(rollout_id=r.rollout_id, attempt=r.attempt, status=RolloutStatus.QUEUED, task_id=r.task_id,
                     group_id=r.group_id, mode=r.mode, runner_id=runner_id, model_version=r.model_version)
        for r in submission.requests
    ]  # fmt: skip
    await publisher.publish_many(TopicKey.ROLLOUTS, queued)


def _stable_id(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return "t-" + hashlib.sha256(canonical.encode()).hexdigest()[:16]
