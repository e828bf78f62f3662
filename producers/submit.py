"""``fulmen submit``: the tasks of a task file become RolloutRequests on the tasks topic.

The file is read by :func:`fulmen.schemas.task_file.load_task_file` (its docstring is the format), which checks
every line before anything is published, so a bad line never leaves half a submission. Every task becomes
``group_size`` rollouts sharing a fresh ``group_id`` (GRPO compares them), with the settings its line gives
(``--mode`` overrides the lines' ``mode``). Each request is announced as ``queued`` on the rollouts topic once
the tasks topic has acknowledged it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fulmen.infra.kafka.publish import EventPublisher, Sender
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import RolloutEvent, RolloutMode, RolloutRequest, RolloutStatus
from fulmen.schemas.task_file import TaskSpec
from fulmen.schemas.topics import TopicKey

__all__ = ["SENDER", "Submission", "publish", "requests_for"]

SENDER = Sender("submit", (TopicKey.TASKS, TopicKey.ROLLOUTS))


@dataclass(frozen=True)
class Submission:
    requests: list[RolloutRequest]

    @property
    def groups(self) -> list[str]:
        return sorted({r.group_id for r in self.requests})


def requests_for(tasks: Iterable[TaskSpec], group_size: int, *, mode: RolloutMode | None = None) -> Submission:
    """``group_size`` RolloutRequests per task, sharing a fresh group id; ``mode`` overrides the tasks' own."""
    if group_size < 1:
        raise ConfigurationError("--group-size must be at least 1")
    if mode is not None and not mode.dispatched:
        raise ConfigurationError(
            f"--mode {mode.value}: such rollouts are recorded from agents Fulmen does not run, "
            "never submitted; use train or val"
        )
    requests = []
    for task in tasks:
        options = task.options() | ({"mode": mode} if mode is not None else {})
        group_id = task.new_group_id()
        requests += [
            RolloutRequest(task_id=task.task_id, group_id=group_id, input=task.input, metadata=task.metadata, **options)
            for _ in range(group_size)
        ]
    return Submission(requests)


async def publish(publisher: EventPublisher, submission: Submission, runner_id: str = "fulmen submit") -> None:
    """Publish the requests, then announce each as queued (only once the tasks topic acknowledged it)."""
    await publisher.publish_many(TopicKey.TASKS, submission.requests)
    queued = [
        RolloutEvent(
            rollout_id=r.rollout_id,
            attempt=r.attempt,
            status=RolloutStatus.QUEUED,
            task_id=r.task_id,
            group_id=r.group_id,
            mode=r.mode,
            runner_id=runner_id,
            model_version=r.model_version,
            prompt_bundle=r.prompt_bundle,
        )
        for r in submission.requests
    ]
    await publisher.publish_many(TopicKey.ROLLOUTS, queued)
