"""The system evaluator: a candidate's slots run through the whole system, the way training's validation runs.

For each :meth:`SystemEvaluator.run` (one candidate, some task ids):

1. the candidate becomes a :class:`~fulmen.schemas.prompts.PromptBundle` (content-hashed id, so the same slots are
   the same bundle) and is published on the prompts topic, acknowledged, once per bundle;
2. one ``RolloutRequest`` per task, each naming that bundle (``prompt_bundle``), goes out through a one-pass
   :class:`~fulmen.algorithm.service.dispatcher.Dispatcher` (group size 1, mode ``val``): the runners run the agent
   unchanged, the runner hands it ``/rollout/{id}/attempt/{n}/bundle/{bundle}/v1``, and the gateway applies the
   bundle to every call of that rollout;
3. the rewards come back as ``TransitionBatch`` es through the trainer's :class:`~fulmen.algorithm.service.collector.
   Collector` (its group book closes a group when its rollout ended, or drops it at the deadline: reward 0);
4. the failing episodes (reward below ``success``) get their evidence, what the model saw and answered, read from
   the store by rollout id (:func:`fulmen.algorithm.prompts.evidence.episode_evidence`).

The search calls :meth:`run` from its own thread (the searches are plain Python); the Kafka clients live on the
event loop given to the constructor, and :meth:`run` hands the work to it. The rollout budget is not the
evaluator's business: the search's :class:`~fulmen.algorithm.prompts.base.Scorer` reserves the rollouts before
calling it, i.e. before anything is dispatched. ``max_attempts`` defaults to 1 so that a rollout is one attempt.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from fulmen.algorithm.prompts.base import Episode
from fulmen.algorithm.service.collector import Collector
from fulmen.algorithm.service.dispatcher import DatasetTask, DispatchedGroup, Dispatcher
from fulmen.algorithm.service.groups import ClosedGroup
from fulmen.infra.kafka.publish import EventPublisher
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import RolloutMode
from fulmen.schemas.prompts import PromptBundle
from fulmen.schemas.topics import TopicKey

__all__ = ["EvaluatorOptions", "SystemEvaluator"]

log = logging.getLogger(__name__)

Evidence = Callable[[list[str]], Mapping[str, str]]
"""Rollout ids -> what went wrong in each (the text the optimiser is shown)."""


@dataclass(frozen=True)
class EvaluatorOptions:
    """How the evaluator's rollouts and bundles are made: the agent recorded in each request's metadata, the
    search run's id and name (the bundles' ``run_id`` and ``source``), the original templates of template slots,
    the agent scope a bundle is meant for, the model version the requests name, the rollout timeout and attempts,
    the reward below which an episode is a failure, and a poll bound for a group that never closes."""

    agent: str = ""
    run_id: str = ""
    source: str = "gepa"
    templates: Mapping[str, str] = field(default_factory=dict)
    bundle_agent: str | None = None
    model_version: int = 0
    rollout_timeout_s: float = 300.0
    max_attempts: int = 1
    success: float = 1.0


class SystemEvaluator:
    """An :class:`~fulmen.algorithm.prompts.base.Evaluator` over the real system (module docstring).

    ``dispatch`` publishes on the tasks and rollouts topics (the trainer's sender), ``bundles`` on the prompts
    topic; ``collector`` reads this run's transitions (its own consumer group). ``check`` is called while waiting
    (e.g. ``Services.check``: a service that died stops the wait with its error). ``evidence`` reads the failing
    rollouts from the store (None: episodes carry no evidence)."""

    def __init__(
        self,
        dispatch: EventPublisher,
        bundles: EventPublisher,
        collector: Collector,
        tasks: Sequence[DatasetTask],
        loop: asyncio.AbstractEventLoop,
        options: EvaluatorOptions,
        *,
        evidence: Evidence | None = None,
        check: Callable[[], None] = lambda: None,
    ) -> None:
        ids = [task.task_id for task in tasks]
        if len(set(ids)) != len(ids):
            raise ConfigurationError("the evaluator's tasks must have distinct task ids (train, val and test together)")
        self.dispatch, self.bundles, self.collector = dispatch, bundles, collector
        self.tasks = {task.task_id: task for task in tasks}
        self.loop, self.options = loop, options
        self.evidence, self.check = evidence, check
        self.published: dict[str, PromptBundle] = {}
        self.rollout_ids: list[str] = []  # every rollout dispatched, in order

    def bundle(self, slots: Mapping[str, str]) -> PromptBundle:
        """The bundle these slots make (its id is the candidate's id)."""
        o = self.options
        return PromptBundle.create(slots, templates=o.templates, agent=o.bundle_agent, source=o.source, run_id=o.run_id)

    def run(self, slots: Mapping[str, str], task_ids: Sequence[str]) -> list[Episode]:
        """One episode per task id, in order; called from a thread other than the event loop's."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            raise RuntimeError("SystemEvaluator.run blocks: call it from another thread, or await evaluate()")
        return asyncio.run_coroutine_threadsafe(self.evaluate(slots, task_ids), self.loop).result()

    async def evaluate(self, slots: Mapping[str, str] | None, task_ids: Sequence[str]) -> list[Episode]:
        """:meth:`run` on the event loop; ``slots`` None: the rollouts name no bundle (the agent's own prompts, or
        the promoted bundle)."""
        unknown = [t for t in task_ids if t not in self.tasks]
        if unknown:
            raise ConfigurationError(f"unknown task id(s) {', '.join(unknown[:5])}: not in the evaluator's tasks")
        if not task_ids:
            return []
        bundle = self.bundle(slots) if slots is not None else None
        if bundle is not None and bundle.bundle_id not in self.published:
            await self.bundles.publish_many(TopicKey.PROMPTS, [bundle])
            self.published[bundle.bundle_id] = bundle
        o = self.options
        dispatcher = Dispatcher(
            self.dispatch,
            [self.tasks[t] for t in task_ids],
            group_size=1,
            max_in_flight=len(task_ids),
            mode=RolloutMode.VAL,
            cycle=False,
            rollout_timeout_s=o.rollout_timeout_s,
            max_attempts=o.max_attempts,
            metadata={"agent": o.agent} if o.agent else None,
            prompt_bundle=bundle.bundle_id if bundle is not None else None,
        )
        groups = await dispatcher.fill(o.model_version)
        self.rollout_ids += [r for g in groups for r in g.rollout_ids]
        self.collector.expect(groups)
        closed = await self._wait(groups)
        episodes = [_episode(group, closed[group.group_id]) for group in groups]
        return await self._with_evidence(episodes)

    async def _wait(self, groups: list[DispatchedGroup]) -> dict[str, ClosedGroup]:
        pending = {g.group_id for g in groups}
        closed: dict[str, ClosedGroup] = {}
        started = time.monotonic()
        while pending:
            self.check()
            for group in await self.collector.poll():
                if group.group_id in pending:
                    pending.discard(group.group_id)
                    closed[group.group_id] = group
                else:
                    log.warning("a group this evaluation did not dispatch closed: %s", group.group_id)
        self.collector.done(closed)
        await self.collector.commit()
        log.info(
            "%d rollout(s) of %s back in %.1f s",
            len(groups),
            groups[0].rollout_ids[0] if groups else "-",
            time.monotonic() - started,
        )
        return closed

    async def _with_evidence(self, episodes: list[Episode]) -> list[Episode]:
        failing = [e.rollout_id for e in episodes if e.reward < self.options.success]
        if self.evidence is None or not failing:
            return episodes
        found = await asyncio.to_thread(self.evidence, failing)
        return [
            e
            if e.reward >= self.options.success
            else Episode(e.task_id, e.reward, e.rollout_id, found.get(e.rollout_id) or "(no LLM call was recorded)")
            for e in episodes
        ]


def _episode(spec: DispatchedGroup, group: ClosedGroup) -> Episode:
    """The group's one rollout as an episode: its episode reward (0 when it has none: failed, timed out, dropped)."""
    batch = group.rollouts[-1] if group.rollouts else None
    reward = batch.episode_reward if batch is not None and batch.episode_reward is not None else 0.0
    return Episode(spec.task_id, float(reward), batch.rollout_id if batch is not None else spec.rollout_ids[0])
