"""The dispatcher: a dataset of tasks -> groups of ``RolloutRequest``s on the tasks topic, bounded in flight.

The dataset is a task file (:mod:`fulmen.schemas.task_file`, the same format ``fulmen submit`` reads), loaded
with :func:`~fulmen.schemas.task_file.load_task_file`. The dispatcher takes each task's id, input and metadata;
the requests' mode, timeout and attempts are the run's own (its ``mode``, ``rollout_timeout_s`` and
``max_attempts``, which the collector's group deadline is computed from), and it warns once when tasks set
their own.

Lifecycle: build with a publisher and the tasks; call :meth:`Dispatcher.fill` with the version the gateways
serve: it publishes groups (``group_size`` requests sharing a fresh ``group_id``) until ``max_in_flight``
groups are out, then returns. A group stays in flight until :meth:`Dispatcher.release` (the collector completed
or dropped it), so ``fill`` waits for groups to finish before dispatching more. The tasks are read in passes:
``cycle=True`` (training) starts another pass, reshuffled with the seed, when one ends; ``cycle=False``
(validation) stops after one pass (:attr:`Dispatcher.exhausted`) until :meth:`Dispatcher.rewind`. Each request
is announced as ``queued`` on the rollouts topic once the tasks topic acknowledged it. ``prompt_bundle``: every
request names this prompt bundle (the gateway applies it to the rollout's calls; the prompt search's evaluator).
Each request carries a sampling seed derived from the dispatcher's ``seed``, its mode, the group's number and
the member's place in it (:func:`fulmen.infra.seeds.derive_seed`): the same run seed dispatches the same seeds in
the same order, so a rerun samples the same tokens as far as the engine allows.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

from fulmen.infra.kafka.publish import EventPublisher
from fulmen.infra.seeds import derive_seed
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import RolloutEvent, RolloutMode, RolloutRequest, RolloutStatus
from fulmen.schemas.task_file import TaskSpec
from fulmen.schemas.topics import TopicKey

__all__ = ["DatasetTask", "DispatchedGroup", "Dispatcher"]

log = logging.getLogger(__name__)

DatasetTask = TaskSpec  # one task of the dataset: a task file's task (the name the algorithm's callers use)


@dataclass(frozen=True)
class DispatchedGroup:
    """A published group: what the collector needs to know to complete it."""

    group_id: str
    task_id: str
    mode: RolloutMode
    size: int
    max_attempts: int
    model_version: int
    rollout_ids: tuple[str, ...]


class Dispatcher:
    """Publishes groups of rollout requests for the tasks, at most ``max_in_flight`` unfinished at a time."""

    def __init__(
        self,
        publisher: EventPublisher,
        tasks: Sequence[DatasetTask],
        *,
        group_size: int,
        max_in_flight: int,
        mode: RolloutMode = RolloutMode.TRAIN,
        cycle: bool = True,
        shuffle: bool = False,
        seed: int = 0,
        rollout_timeout_s: float = 600.0,
        max_attempts: int = 3,
        metadata: dict[str, str] | None = None,
        prompt_bundle: str | None = None,
    ) -> None:
        if not tasks:
            raise ConfigurationError("the dispatcher needs at least one task")
        if group_size < 1 or max_in_flight < 1:
            raise ConfigurationError(f"group_size ({group_size}) and max_in_flight ({max_in_flight}) must be >= 1")
        self.publisher = publisher
        self.tasks = list(tasks)
        self.group_size = group_size
        self.max_in_flight = max_in_flight
        self.mode = mode
        self.cycle = cycle
        self.shuffle = shuffle
        self.rollout_timeout_s = rollout_timeout_s
        self.max_attempts = max_attempts
        self.metadata = dict(metadata or {})
        self.prompt_bundle = prompt_bundle
        self.in_flight: dict[str, DispatchedGroup] = {}
        self.seed = seed
        self.groups_made = 0
        self.passes = 0
        self.dispatched = 0
        self._random = random.Random(seed)
        self._order: list[DatasetTask] = []
        self._next = 0
        self._new_pass()
        _warn_of_own_options(self.tasks)

    @property
    def exhausted(self) -> bool:
        """True when a one-pass dispatcher has dispatched every task."""
        return not self.cycle and self._next >= len(self._order)

    @property
    def idle(self) -> bool:
        """Nothing in flight and nothing more to dispatch."""
        return self.exhausted and not self.in_flight

    async def fill(self, model_version: int, ahead: int = 0) -> list[DispatchedGroup]:
        """Dispatch groups until ``max_in_flight`` are out, counting ``ahead`` groups the caller holds that count
        against the bound too (closed, not yet trained on), or a one-pass dataset ends; the new groups."""
        groups: list[DispatchedGroup] = []
        requests: list[RolloutRequest] = []
        while len(self.in_flight) + ahead + len(groups) < self.max_in_flight and not self.exhausted:
            group, group_requests = self._group(self._take(), model_version)
            groups.append(group)
            requests.extend(group_requests)
        if not groups:
            return []
        await self.publisher.publish_many(TopicKey.TASKS, requests)
        await self.publisher.publish_many(TopicKey.ROLLOUTS, [_queued(r) for r in requests])
        for group in groups:
            self.in_flight[group.group_id] = group
        self.dispatched += len(groups)
        log.info(
            "dispatched %d %s group(s) of %d at model version %d (%d in flight)",
            len(groups),
            self.mode.value,
            self.group_size,
            model_version,
            len(self.in_flight),
        )
        return groups

    def rewind(self, only: set[str] | None = None) -> None:
        """Start a new pass over the tasks now (a one-pass dispatcher dispatches them all again); with ``only``,
        over the tasks with those ids alone."""
        self._new_pass()
        if only is not None:
            self._order = [task for task in self._order if task.task_id in only]

    def skip(self, groups: int) -> None:
        """Move past the tasks of ``groups`` groups without dispatching them: a resumed run continues its dataset
        where its steps left it (the same seeded order, the same passes)."""
        for _ in range(groups):
            self._take()

    def release(self, group_id: str) -> DispatchedGroup | None:
        """The group finished (completed or dropped): it no longer counts as in flight. None if not ours."""
        return self.in_flight.pop(group_id, None)

    def _take(self) -> DatasetTask:
        if self._next >= len(self._order):
            self._new_pass()
        task = self._order[self._next]
        self._next += 1
        return task

    def _new_pass(self) -> None:
        self._order = list(self.tasks)
        if self.shuffle:
            self._random.shuffle(self._order)
        self._next = 0
        self.passes += 1

    def _group(self, task: DatasetTask, model_version: int) -> tuple[DispatchedGroup, list[RolloutRequest]]:
        group_id, number = task.new_group_id(), self.groups_made
        self.groups_made += 1
        requests = [
            RolloutRequest(
                task_id=task.task_id,
                group_id=group_id,
                mode=self.mode,
                input=task.input,
                timeout_s=self.rollout_timeout_s,
                max_attempts=self.max_attempts,
                model_version=model_version,
                metadata={**self.metadata, **task.metadata},
                prompt_bundle=self.prompt_bundle,
                seed=derive_seed(self.seed, self.mode.value, number, member),
            )
            for member in range(self.group_size)
        ]
        group = DispatchedGroup(
            group_id=group_id,
            task_id=task.task_id,
            mode=self.mode,
            size=self.group_size,
            max_attempts=self.max_attempts,
            model_version=model_version,
            rollout_ids=tuple(r.rollout_id for r in requests),
        )
        return group, requests


def _warn_of_own_options(tasks: Sequence[DatasetTask]) -> None:
    setting = [task for task in tasks if task.options()]
    if setting:
        names = sorted({name for task in setting for name in task.options()})
        lines = ", ".join(str(task.line) for task in setting[:5] if task.line is not None)
        log.warning(
            "%d task(s) set %s (lines %s%s); the run's own settings apply to every rollout",
            len(setting),
            "/".join(names),
            lines or "-",
            ", ..." if len(setting) > 5 else "",
        )


def _queued(request: RolloutRequest) -> RolloutEvent:
    return RolloutEvent(
        rollout_id=request.rollout_id,
        attempt=request.attempt,
        status=RolloutStatus.QUEUED,
        task_id=request.task_id,
        group_id=request.group_id,
        mode=request.mode,
        runner_id="fulmen train",
        model_version=request.model_version,
        prompt_bundle=request.prompt_bundle,
    )
