"""The training loop: dispatch -> collect a step's groups -> samples -> update -> checkpoint -> publish.

One step N (the policy being served is version ``N - 1``; version 0 is the base model):

1. keep ``max_groups_in_flight`` train groups dispatched (:class:`~fulmen.algorithm.service.dispatcher.Dispatcher`,
   requests stamped with the served version) and poll the :class:`~fulmen.algorithm.service.collector.Collector` until
   ``groups_per_step`` kept train groups are ready (``rollout_wait_s``);
2. (control runs only, ``shuffle_rewards``: permute the rewards across the step's rollouts,
   :func:`~fulmen.algorithm.service.groups.shuffle_rewards`); drop the transitions older than ``max_staleness`` versions
   (:func:`~fulmen.algorithm.service.groups.drop_stale`, counted as ``dropped_stale``; a group left empty is replaced by
   the next), credit each call from its rollout's episode reward and the calls' intermediate rewards with the run's
   strategy (``credit``, ``gamma``: :func:`~fulmen.algorithm.service.groups.credit_groups`; the transitions topic
   carries only what was observed), build one sample per transition with its group advantage
   (:func:`~fulmen.algorithm.service.samples.build_samples`, estimator and scope from the settings; with the ``anchor``
   credit, plus each call's advantage within the calls of its group that saw the same prompt; with
   ``overlong_shaping`` each call's length penalty is added to the rewards first);
   with ``dynamic_sampling`` (DAPO) a group whose rewards are all equal
   (:func:`~fulmen.algorithm.service.samples.has_signal`) is done with, not trained on, and the step waits for the next
   group instead: at most ``dynamic_sampling_bound`` groups a step (counted as ``filtered_groups``); past that bound the
   step takes groups as they come (``dynamic_sampling_exhausted`` = 1, and a warning);
3. one policy update (``backend.step``, in a worker thread so Kafka heartbeats go on; ``train_s``);
4. save the checkpoint to ``<run dir>/checkpoints/v<N>`` (atomically: ``TrainerBackend.save``; with
   ``checkpoint_uri`` uploaded too), publish ``ModelVersion(version=N)`` and wait for the broker's acknowledgement
   (``publish_s``), retried with backoff so that a version is on the topic at most once (:meth:`_publish_event`)
   until it lands or ``stop`` is set: then ``fulmen train`` publishes it on restart (:meth:`publish_resumed`);
5. with a validation set, when due (before step 1, every ``val_every`` steps, after the last step): dispatch
   every validation task, wait for all its groups, report ``val_accuracy`` = share of validation rollouts whose
   EPISODE REWARD IS > 0.5 (None counts as wrong) and ``val_reward_mean`` (None counts as
   ``missing_reward``) in the step's ``TrainStep.extra`` (the initial one as ``initial_val_*`` in step 1's); a
   ``val_accuracy`` at or above ``stop_at_val_accuracy`` ends the run after this step (early stopping);
6. publish ``TrainStep`` on the metrics topic (``reward_mean``/``reward_std``: population statistics of the step's
   rollout returns; ``advantage_*``: of its samples; ``dropped_stale``: transitions; ``extra['entropy']``: the
   sampler's per-token entropy, the mean negative logprob of the tokens it sampled), hand it to ``on_step``
   (:mod:`fulmen.algorithm.service.reporting`: metrics.jsonl, TensorBoard, curves.png); mark the step's groups
   done and commit the collector's offsets (only now: a crash before this point redelivers the step's
   transitions).

Modes (``mode``). ``sync`` (the default) is the order above: a step dispatches and polls only while it waits for
its groups (1.); rollouts already dispatched run on while it trains, nothing new is dispatched until the next step
waits, so samples are at most ``max_staleness`` (default 1) versions old. ``async``: a feeder task
(:meth:`TrainingLoop._feed`) dispatches and collects without pause during updates, saves and publishes (during
validations it collects but dispatches no train groups, which would queue ahead of the validation's rollouts),
keeping ``groups_in_flight`` train groups ahead of training (dispatched or closed and waiting:
``(max_staleness + 1) * groups_per_step`` by default) at the version being served; a step takes the groups that
closed, drops transitions older than ``max_staleness`` versions (each call's own version: the gateways swap
versions between calls, so one rollout may span versions), and the trainer weighs the rest against the policy that
sampled them (the ``correction``, ``tis`` by default in this mode). Every step reports how old its samples were:
``staleness_<k>`` (samples k versions old), ``staleness_max``, ``staleness_mean`` in ``TrainStep.extra``.

Per-agent adapters (``adapters`` = per_agent, ``adapter_agents``): the backend keeps one LoRA adapter per agent
(:class:`~fulmen.algorithm.trainer.adapters.PerAgentTrainer`). A step keeps only the calls of those agents (the rest
are counted as ``dropped_other_agents``), builds each agent's samples within its own groups
(:func:`~fulmen.algorithm.service.samples.build_agent_samples`) and updates each adapter from its own; every step
publishes one ``ModelVersion`` per adapter (``adapter`` = the agent, ``format`` = hf_lora_adapter, uri
``<checkpoint>/<agent>``, all at version N: staleness and validation compare versions as for one model). A run
that starts from the base publishes each adapter's initial state as version 0 (the base's outputs exactly; after
the base itself with ``publish_initial_version``); until a gateway has loaded it, the agent's calls are served by
the base model, which gives the same answers and is labelled version 0 too.

Gated promotion (``promote_if_better``, :mod:`fulmen.algorithm.service.promotion`): every step validates, and the
:class:`~fulmen.algorithm.service.promotion.PromotionGate` promotes or rejects the new version on its held-out accuracy;
the decision (a ``ModelPromotion``) is published on the promotions topic before the step's metrics, which report
``promoted`` (1 or 0), ``serving_version`` and ``serving_score``.

Replay (``replay_sql``, :mod:`fulmen.algorithm.service.replay`, which says what is reported): groups read from the
store. Without a dataset every group of a step comes from it; with one, ``replay_fraction`` of ``groups_per_step``
do. Replayed groups go through the same staleness, length, agent and signal checks.

Only the latest attempt of each rollout is trained on: retried attempts are never built (transitions worker)
and the collector keeps the latest attempt per rollout (see ``fulmen.algorithm.service.collector``).

With ``publish_initial_version``, a run that starts from the base model (version 0) publishes it first; a resumed
run does not (its version is a checkpoint: see :meth:`TrainingLoop.publish_resumed`).

Errors: ``BrokerUnavailableError`` when Kafka does not acknowledge a dispatch (model versions and step metrics
are retried instead); ``PoisonInputError`` from the backend for a sample it can never train on (transitions
longer than ``max_len`` are dropped before, and counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from fulmen.algorithm.rl.shaping import OverlongShaping
from fulmen.algorithm.service.checkpoints import checkpoint_dir, prune_checkpoints, published_uri, version_events
from fulmen.algorithm.service.collector import Collector
from fulmen.algorithm.service.dispatcher import Dispatcher
from fulmen.algorithm.service.groups import (
    ClosedGroup,
    credit_groups,
    drop_stale,
    drop_too_long,
    keep_agents,
    served_before,
    shuffle_rewards,
    validation_summary,
)
from fulmen.algorithm.service.promotion import PromotionGate, save_baseline
from fulmen.algorithm.service.replay import ReplayBuffer
from fulmen.algorithm.service.samples import (
    StepSamples,
    build_agent_samples,
    build_samples,
    has_signal,
    sampled_entropy,
    staleness_counts,
    staleness_extra,
)
from fulmen.algorithm.settings import TrainMode, TrainSection
from fulmen.algorithm.trainer.base import TRAINING_STATE, StepMetrics, TrainerBackend
from fulmen.infra.kafka.publish import EventPublisher
from fulmen.schemas.errors import ConfigurationError, RetryableError
from fulmen.schemas.events import Event, ModelVersion, PromotionAction, RolloutMode, TrainStep
from fulmen.schemas.topics import TopicKey

__all__ = ["LoopPlan", "TrainingLoop", "VersionCheck"]

log = logging.getLogger(__name__)

VAL_REDO = 5
"""How many times validation runs again the tasks whose calls an older model version served (waiting 0.5 s,
doubling, before each): the gateways load a new version a moment after it is published."""

ARRIVAL_WAIT_S = 0.2
"""Asynchronous mode: how long a step waiting for groups sleeps before it looks again (the feeder wakes it as soon
as groups are filed)."""

FEED_IDLE_S = 0.05
"""Asynchronous mode: the feeder's pause when a round dispatched nothing and nothing closed."""

RETRY_BACKOFF_S = (1.0, 30.0)
"""Waits between attempts to publish a model version or step metrics: the first, doubling up to the second."""

STOP_GRACE_S = 2.0
"""How long an attempt to publish (or to look for) a version or metrics may go on once ``stop`` is set: a broker
that answers does so in milliseconds; during an outage the attempt is cancelled rather than waited out."""

VersionCheck = Callable[[ModelVersion], Awaitable[bool]]
"""Whether the models topic already holds this version (of this run); raises ``RetryableError`` when unsure."""


@dataclass
class LoopPlan:
    """What the loop needs besides its collaborators: the train section, where to write, the base model (as
    ``ModelVersion.base_model`` names it) and the version the backend's weights are (0 = the base model)."""

    train: TrainSection
    run_dir: Path
    base_model: str
    initial_version: int = 0


@dataclass
class _Waiting:
    """Closed groups not yet used: kept train groups in arrival order, validation groups."""

    train: list[ClosedGroup] = field(default_factory=list)
    val: list[ClosedGroup] = field(default_factory=list)
    dropped_groups: int = 0
    partial_groups: int = 0


class TrainingLoop:
    """Runs the steps described in the module docstring; build with its collaborators, then :meth:`run`."""

    def __init__(
        self,
        plan: LoopPlan,
        backend: TrainerBackend,
        publisher: EventPublisher,
        collector: Collector,
        train: Dispatcher | None,
        val: Dispatcher | None = None,
        *,
        replay: ReplayBuffer | None = None,
        gate: PromotionGate | None = None,
        clock: Callable[[], float] = time.perf_counter,
        version_published: VersionCheck | None = None,
        retry_backoff_s: tuple[float, float] = RETRY_BACKOFF_S,
        stop_grace_s: float = STOP_GRACE_S,
        on_step: Callable[[TrainStep], None] | None = None,
    ) -> None:
        self.plan = plan
        self.on_step = on_step
        self.options = plan.train
        self.backend = backend
        self.publisher = publisher
        self.collector = collector
        if train is None and replay is None and plan.train.steps > 0:
            raise ValueError("a training loop needs tasks to dispatch or a replay buffer (or steps=0: validate only)")
        self.train = train
        self.val = val
        self.replay = replay
        self.gate = gate
        self.replay_share = _replay_share(plan.train, replay, train)
        self.clock = clock
        self.version_published = version_published
        self.retry_backoff_s = retry_backoff_s
        self.stop_grace_s = stop_grace_s
        self.version = plan.initial_version
        self.waiting = _Waiting()
        limits = plan.train.overlong_limits  # ConfigurationError when shaping is on without its limit
        self.overlong = OverlongShaping(*limits) if limits else None
        self.filtered_groups = 0
        self.feeding = plan.train.mode is TrainMode.ASYNC  # a background task dispatches and collects
        self._arrived = asyncio.Event()  # set whenever closed groups were filed
        self._collector_lock = asyncio.Lock()  # one poll or commit at a time on the consumer
        self._feed_error: Exception | None = None
        self._in_step = 0  # groups the step under way took (trained on at the version being served)
        self._validating = False  # a validation pass is under way: the feeder dispatches no train groups
        self.val_outcomes: dict[str, float] = {}  # the last validation's share of correct rollouts, per task
        self.agents = plan.train.per_agent  # per-agent adapters: their agents; None: one policy

    async def run(self, stop: asyncio.Event | None = None) -> list[TrainStep]:
        """Train up to step ``steps`` (from ``initial_version + 1``: a resumed run continues its numbering; fewer
        when ``stop`` is set, which is checked between polls); the published TrainStep events."""
        stop = stop or asyncio.Event()
        # the base model is version 0 only; a resumed run serves a checkpoint (train() calls publish_resumed)
        from_base = self.plan.initial_version == 0
        initial = from_base and (self.options.publish_initial_version or self.agents)
        if initial and not await self._publish_initial(stop):
            return []
        feeder = asyncio.create_task(self._feed(stop)) if self.feeding else None
        try:
            published = await self._steps(stop)
        finally:
            if feeder is not None:
                feeder.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await feeder
        log.info(
            "run %s finished after %d step(s) at model version %d", self.options.run_id, len(published), self.version
        )
        return published

    async def _steps(self, stop: asyncio.Event) -> list[TrainStep]:
        # a resumed gated run whose serving version's outcomes are known (its promotion's) needs no first pass
        known = (
            self.version > 0
            and self.gate is not None
            and self.val is not None
            and self.gate.knows(t.task_id for t in self.val.tasks)
        )
        initial = await self._validate(stop, prefix="initial_val_") if self.val and not known else {}
        if self.gate is not None and "initial_val_accuracy" in initial:
            self.gate.know_serving(initial["initial_val_accuracy"], self.val_outcomes)
            save_baseline(self.plan.run_dir, self.gate)
        published = []
        for number in range(self.version + 1, self.options.steps + 1):
            event = await self.step(number, stop, extra=initial)
            if event is None:
                break
            published.append(event)
            if self.on_step is not None:
                self.on_step(event)
            if self._target_reached(event):
                break
            initial = {}
        return published

    def _target_reached(self, event: TrainStep) -> bool:
        """Whether this step's held-out accuracy reached ``stop_at_val_accuracy`` (early stopping)."""
        target, accuracy = self.options.stop_at_val_accuracy, event.extra.get("val_accuracy")
        if target is None or accuracy is None or accuracy < target:
            return False
        log.info("held-out accuracy %.3f reached %.3f at step %d: stopping early", accuracy, target, event.step)
        return True

    async def _feed(self, stop: asyncio.Event) -> None:
        """Asynchronous mode: keep ``groups_in_flight`` train groups ahead of training (dispatched at the version
        being served, closed and waiting for a step, or taken by the step under way: so a group dispatched at
        version v is trained by step v + max_staleness + 1 at the latest, at most ``max_staleness`` versions old)
        and file whatever closes, without pause, while the steps train, save and publish (during a validation pass
        it dispatches no train groups: they would queue at the gateways ahead of the validation's rollouts, and
        the train groups under way keep running). The only poller of the collector then (the steps wait for
        :attr:`_arrived`). A Kafka error ends the run: it is re-raised in the step that waits (:meth:`_advance`)."""
        try:
            while not stop.is_set():
                ahead = len(self.waiting.train) + self._in_step  # closed, and taken by the step under way
                on_policy = self.train is not None and not self._validating
                dispatched = await self.train.fill(self.version, ahead=ahead) if on_policy else []
                self.collector.expect(dispatched)
                if not await self._poll() and not dispatched:
                    await asyncio.sleep(FEED_IDLE_S)  # a consumer that answers at once must not spin the loop
        except Exception as exc:
            self._feed_error = exc
            self._arrived.set()
            raise

    async def _advance(self) -> None:
        """Let more closed groups arrive: in synchronous mode by polling the collector here; in asynchronous mode
        by waiting (at most ``ARRIVAL_WAIT_S``, then the caller looks again) for the feeder to file some."""
        if not self.feeding:
            await self._poll()
            return
        if self._feed_error is not None:
            raise self._feed_error
        self._arrived.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._arrived.wait(), ARRIVAL_WAIT_S)

    async def step(self, number: int, stop: asyncio.Event, extra: dict[str, float] | None = None) -> TrainStep | None:
        """One step (module docstring); None when ``stop`` was set while waiting for rollouts."""
        started = self.clock()
        collected = await self._collect_train(stop)
        if collected is None:
            return None
        groups, dropped = collected
        waited = self.clock() - started
        groups, data = self._samples(groups, number)
        staleness = staleness_counts(data.samples, self.version)
        metrics = await asyncio.to_thread(self.backend.step, data.samples)
        published = self.clock()
        if self.replay is not None:  # before the checkpoint: a run resumed from it goes on past these groups
            await asyncio.to_thread(self.replay.save_position, self.plan.run_dir, number, self.options.replay_sql)
        path = await asyncio.to_thread(self.backend.save, checkpoint_dir(self.plan.run_dir, number))
        (checkpoint_dir(self.plan.run_dir, number - 1) / TRAINING_STATE).unlink(missing_ok=True)  # the latest has it
        serving = {self.gate.serving.version} if self.gate is not None else set()
        prune_checkpoints(self.plan.run_dir, number, self.options.keep_checkpoints, serving)
        uri = await asyncio.to_thread(published_uri, path, self.options.run_id, self.options.checkpoint_uri)
        if not await self._publish_version(uri, number, stop):
            return None
        self.version = number
        self._in_step = 0
        publish_s = self.clock() - published
        extra = {**(extra or {}), **self._extra(metrics, dropped, data), **staleness_extra(staleness)}
        if self.val is not None and self._validation_due(number):
            extra.update(await self._validate(stop, prefix="val_"))
        if not await self._decide_promotion(number, uri, extra, stop):
            return None
        event = self._train_step(
            number, groups, data, metrics, extra, waited=waited, publish_s=publish_s, stale=dropped["stale"]
        )
        if not await self._publish_metrics(event, stop):
            return None
        self.collector.done(g.group_id for g in groups)
        await self._commit()
        log.info(
            "step %d: %d transitions of %d groups, reward %.3f, loss %.4f; model version %d at %s",
            number,
            event.num_transitions,
            event.num_groups,
            event.reward_mean,
            event.loss,
            number,
            path,
        )
        return event

    def _samples(self, groups: list[ClosedGroup], number: int) -> tuple[list[ClosedGroup], StepSamples]:
        """Step ``number``'s groups with their credit assigned (rewards shuffled first in the control run), and the
        samples the backend trains on."""
        if self.options.shuffle_rewards:  # the control run: rewards detached from the answers they scored
            groups = shuffle_rewards(groups, seed=self.options.seed * 100_003 + number)
        groups = credit_groups(groups, self.options.credit, self.options.gamma)
        options = {
            "estimator": self.options.estimator,
            "scope": self.options.advantage_scope,
            "missing_reward": self.options.missing_reward,
            "overlong": self.overlong,
            "step_weight": self.options.step_advantage_weight,
        }
        data = build_agent_samples(groups, self.agents, **options) if self.agents else build_samples(groups, **options)
        return groups, data

    async def _decide_promotion(self, number: int, path: str, extra: dict[str, float], stop: asyncio.Event) -> bool:
        """With a promotion gate and a validation score: publish the gate's decision on version ``number`` and add
        it to ``extra``; False when ``stop`` was set before it was acknowledged."""
        if self.gate is None or "val_accuracy" not in extra:
            return True
        decision = self.gate.decide(self._versions(path, number)[0], extra["val_accuracy"], self.val_outcomes)
        what = f"publishing the promotion decision of version {number}"
        if await self._retrying(lambda retry: self._send(TopicKey.PROMOTIONS, decision), stop, what) is None:
            return False
        extra.update(
            promoted=float(decision.action is PromotionAction.PROMOTE),
            serving_version=float(self.gate.serving.version),
            serving_score=float(self.gate.serving.score or 0.0),
        )
        return True

    async def _publish_metrics(self, event: TrainStep, stop: asyncio.Event) -> bool:
        """Publish a step's metrics; False when ``stop`` was set before they were acknowledged."""
        what = f"publishing the metrics of step {event.step}"
        if await self._retrying(lambda retry: self._send(TopicKey.METRICS, event), stop, what) is not None:
            return True
        log.warning(
            "stopped before the metrics of step %d were acknowledged; they may be lost (version %d is published)",
            event.step,
            event.model_version,
        )
        return False

    # -- collecting --------------------------------------------------------------------------------------------

    async def _collect_train(self, stop: asyncio.Event) -> tuple[list[ClosedGroup], dict[str, int]] | None:
        """``groups_per_step`` kept train groups with trainable transitions, and how many transitions were
        dropped as ``stale`` and as ``too_long``, and how many groups as ``no_signal`` (dynamic sampling; with
        ``exhausted`` = 1 when its bound was reached), and how many groups were ``replayed``: the first
        ``replay_share`` groups come from the replay buffer, the rest from the dispatched ones. A group left without
        transitions, or without signal, is done with and replaced."""
        selected: list[ClosedGroup] = []
        dropped = {"stale": 0, "too_long": 0, "no_signal": 0, "exhausted": 0, "other_agents": 0, "replayed": 0}
        skips = self.options.dynamic_sampling_bound
        replayed = unusable = 0  # replayed groups taken for this step; replayed groups in a row that had nothing
        while len(selected) < self.options.groups_per_step:
            if stop.is_set():
                return None
            from_replay = self.replay is not None and replayed < self.replay_share
            if from_replay:
                if unusable >= len(self.replay.groups):
                    raise ConfigurationError(
                        f"no replayed group is trainable at model version {self.version}: every one was stale "
                        f"(older than FULMEN_TRAIN_MAX_STALENESS={self.options.max_staleness} versions), too long "
                        "or without signal; raise --max-staleness or select newer rollouts"
                    )
                taken = self.replay.take()
            elif not self.waiting.train:
                assert self.train is not None  # without a dataset every group is a replayed one
                if not self.feeding:
                    self.collector.expect(await self.train.fill(self.version))
                await self._advance()
                continue
            else:
                taken = self.waiting.train.pop(0)
            group = self._trainable(taken, dropped)
            if group is None:
                unusable += from_replay
            elif from_replay:
                selected.append(group)
                replayed += 1
                unusable = 0
            else:
                selected.append(group)
                self._in_step += 1
        dropped["replayed"] = replayed
        if skips and dropped["no_signal"] >= skips:
            dropped["exhausted"] = 1
            log.warning(
                "dynamic sampling skipped %d groups without signal in one step (the bound, "
                "FULMEN_TRAIN_DYNAMIC_SAMPLING_MAX_SKIPPED) and took the rest as they came: most tasks are "
                "too easy or too hard for the model at version %d",
                skips,
                self.version,
            )
        self.filtered_groups += dropped["no_signal"]
        return selected, dropped

    def _trainable(self, taken: ClosedGroup, dropped: dict[str, int]) -> ClosedGroup | None:
        """``taken`` without its stale and too long transitions (and, with per-agent adapters, the calls of agents
        without one), counted in ``dropped``; None, and the group done with, when nothing is left or its rewards do
        not differ (dynamic sampling, up to its bound a step)."""
        group, stale = drop_stale(taken, self.version, self.options.max_staleness)
        group, too_long = drop_too_long(group, self.options.max_len)
        dropped["stale"] += stale
        dropped["too_long"] += too_long
        if self.agents:  # per-agent adapters: only the calls of the agents that have one
            group, others = keep_agents(group, self.agents)
            dropped["other_agents"] += others
        if not group.num_transitions:
            self.collector.done([group.group_id])
            return None
        if dropped["no_signal"] < self.options.dynamic_sampling_bound and not self._has_signal(group):
            dropped["no_signal"] += 1
            self.collector.done([group.group_id])
            log.debug("group %s: all rewards equal, not trained on (dynamic sampling)", group.group_id)
            return None
        return group

    async def _commit(self) -> None:
        async with self._collector_lock:
            await self.collector.commit()

    def _has_signal(self, group: ClosedGroup) -> bool:
        """Whether the rewards the estimator will compare in ``group`` (credited, shaped) differ."""
        credited = credit_groups([group], self.options.credit, self.options.gamma)[0]
        return has_signal(credited, self.options.advantage_scope, self.options.missing_reward, self.overlong)

    async def _poll(self) -> bool:
        """File the groups that closed; whether any did."""
        async with self._collector_lock:
            closed = await self.collector.poll()
        for group in closed:
            dispatcher = self.val if group.mode is RolloutMode.VAL else self.train
            if dispatcher is not None:
                dispatcher.release(group.group_id)
            self.waiting.partial_groups += group.partial and group.kept
            if group.mode is RolloutMode.VAL:
                self.waiting.val.append(group)  # validation reports whatever arrived
            elif group.kept:
                self.waiting.train.append(group)
            else:
                self.waiting.dropped_groups += 1
        if closed:
            self._arrived.set()
        return bool(closed)

    async def _validate(self, stop: asyncio.Event, prefix: str) -> dict[str, float]:
        """Run every validation task once at the current version; accuracy and mean episode reward.

        The LLM gateways load a version when they read it on the models topic, a moment after it is published, so
        the first validation rollouts may be served by the version before. A group with a call served by an older
        version is not counted: its task runs again, after a short wait (up to ``VAL_REDO`` times; after that it
        is counted with a warning). ``<prefix>redone`` says how many groups ran again, ``<prefix>s`` how many
        seconds the pass took."""
        if self.val is None:
            return {}
        self._validating = True
        started = self.clock()
        try:
            return {**await self._validation_pass(stop, prefix), f"{prefix}s": self.clock() - started}
        finally:
            self._validating = False

    async def _validation_pass(self, stop: asyncio.Event, prefix: str) -> dict[str, float]:
        counted: list[ClosedGroup] = []
        only: set[str] | None = None
        redone = 0
        for attempt in range(VAL_REDO + 1):
            self.val.rewind(only)
            while not self.val.idle and not stop.is_set():
                self.collector.expect(await self.val.fill(self.version))
                await self._advance()
            groups, self.waiting.val = self.waiting.val, []
            self.collector.done(g.group_id for g in groups)
            older = [g for g in groups if served_before(g, self.version, self.agents)]
            counted += [g for g in groups if g not in older]
            if not older or stop.is_set() or attempt == VAL_REDO:
                if older:
                    log.warning(
                        "validation at model version %d: %d group(s) still served by an older version after "
                        "%d tries; counted anyway",
                        self.version,
                        len(older),
                        VAL_REDO,
                    )
                counted += older
                break
            redone += len(older)
            only = {g.task_id for g in older}
            log.info(
                "validation at model version %d: %d group(s) were served by an older version (the gateway had "
                "not loaded it yet); running them again",
                self.version,
                len(older),
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5 * 2**attempt)
        await self._commit()
        figures, self.val_outcomes = validation_summary(counted, self.options.missing_reward)
        if not figures:
            return {}
        log.info(
            "validation at model version %d: accuracy %.3f, mean reward %.3f over %d rollouts",
            self.version,
            figures["accuracy"],
            figures["reward_mean"],
            figures["rollouts"],
        )
        return {f"{prefix}{key}": value for key, value in figures.items()} | {f"{prefix}redone": float(redone)}

    def _validation_due(self, number: int) -> bool:
        if self.gate is not None:  # every candidate is judged before it may serve
            return True
        every = self.options.val_every
        last = self.options.steps
        return number == last or (every > 0 and number % every == 0)

    # -- the step's outputs ------------------------------------------------------------------------------------

    async def publish_resumed(self, stop: asyncio.Event) -> bool:
        """For a run resumed from checkpoint ``v<N>``: publish ``ModelVersion(version=N)`` at that checkpoint unless
        the models topic already holds version N of this run (a run killed between saving and the broker's
        acknowledgement never published it). Needs ``version_published``. False when ``stop`` was set first."""
        check = self.version_published
        if self.version == 0 or check is None:
            return True
        path = checkpoint_dir(self.plan.run_dir, self.version)
        uri = await asyncio.to_thread(published_uri, path, self.options.run_id, self.options.checkpoint_uri)
        for event in self._versions(uri, self.version):
            on_topic = await self._retrying(
                lambda retry, e=event: check(e), stop, f"reading model version {self.version}"
            )
            if on_topic is None:
                return self._unpublished(event)
            if on_topic:
                log.info(
                    "model version %d of %s%s is on the models topic already",
                    event.version,
                    event.model_name,
                    f" (agent {event.adapter})" if event.adapter else "",
                )
                continue
            log.info(
                "model version %d of %s was saved at %s but never published: publishing it now",
                event.version,
                event.model_name,
                event.uri,
            )
            if not await self._publish_event(event, stop):
                return False
        return True

    def _versions(self, uri: str, version: int) -> list[ModelVersion]:
        return version_events(self.options, self.plan.base_model, self.agents, uri, version)

    async def _publish_initial(self, stop: asyncio.Event) -> bool:
        """Version 0: the base model (``publish_initial_version``); with per-agent adapters, then (always) each
        adapter's initial state, saved first."""
        if self.options.publish_initial_version and not await self._publish_event(
            version_events(self.options, self.plan.base_model, (), self.plan.base_model, 0)[0], stop
        ):
            return False
        if not self.agents:
            return True
        path = await asyncio.to_thread(self.backend.save, checkpoint_dir(self.plan.run_dir, 0))
        uri = await asyncio.to_thread(published_uri, path, self.options.run_id, self.options.checkpoint_uri)
        return await self._publish_version(uri, 0, stop)

    async def _publish_version(self, uri: str, version: int, stop: asyncio.Event) -> bool:
        """Publish ``version`` at ``uri`` (per-agent adapters: each adapter's) until acknowledged; False when
        ``stop`` was set first (said in the log)."""
        for event in self._versions(uri, version):
            if not await self._publish_event(event, stop):
                return False
        return True

    async def _publish_event(self, event: ModelVersion, stop: asyncio.Event) -> bool:
        """Send ``event`` until the broker acknowledges it; before each retry, wait until the earlier attempt's
        record has left the producer's buffer (``EventPublisher.settle``), then ask ``version_published`` whether it
        landed after all: a version is on the topic at most once. False when ``stop`` was set first (an attempt
        under way gets ``stop_grace_s`` more): the checkpoint stays saved, unpublished."""
        check = self.version_published

        async def send(retry: bool) -> bool:
            if retry:  # the earlier attempt's record may still be buffered: once it is not, the topic is final
                await self.publisher.settle()
            if retry and check is not None and await check(event):  # the attempt that timed out was written
                log.info(
                    "model version %d reached the models topic on an earlier attempt; not sent again", event.version
                )
                return True
            return await self._send(TopicKey.MODELS, event)

        if await self._retrying(send, stop, f"publishing model version {event.version}") is None:
            return self._unpublished(event)
        log.info("published model version %d of %s at %s", event.version, event.model_name, event.uri)
        return True

    def _unpublished(self, event: ModelVersion) -> bool:
        log.warning(
            "stopped before model version %d of %s was acknowledged: it is saved at %s but unpublished; "
            "the next `fulmen train` of run %s publishes it",
            event.version,
            event.model_name,
            event.uri,
            event.run_id,
        )
        return False

    async def _send(self, key: TopicKey, event: Event) -> bool:
        await self.publisher.publish(key, event)
        return True

    async def _retrying(self, call: Callable[[bool], Awaitable[bool]], stop: asyncio.Event, what: str) -> bool | None:
        """``await call(retry)`` until it ends without a ``RetryableError`` (a broker outage): its result; between
        attempts wait ``retry_backoff_s`` (doubling). None when ``stop`` is set before an attempt succeeds (an
        attempt under way when it is set gets ``stop_grace_s`` more, then is cancelled)."""
        delay, longest = self.retry_backoff_s
        retry = False
        while True:
            try:
                return await self._unless_stopped(call(retry), stop)
            except RetryableError as exc:
                log.warning("%s failed (%s); retrying in %.1fs until the broker answers", what, exc, delay)
            try:
                await asyncio.wait_for(stop.wait(), delay)
                return None
            except TimeoutError:
                pass
            retry, delay = True, min(delay * 2, longest)

    async def _unless_stopped(self, attempt: Awaitable[bool], stop: asyncio.Event) -> bool | None:
        """``await attempt``, unless ``stop`` is set and the attempt has not ended ``stop_grace_s`` later: then it
        is cancelled (and has cleaned up) and the answer is None. A record it sent may still land (the next
        attempt, or the next run, looks on the topic first)."""
        task = asyncio.ensure_future(attempt)
        stopped = asyncio.ensure_future(stop.wait())
        cancelled = False
        try:
            await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                await asyncio.wait([task], timeout=self.stop_grace_s)
        finally:
            stopped.cancel()
            if not task.done():
                task.cancel()
                cancelled = True
                await asyncio.wait([task])  # never raises the task's own error, only a cancellation of ours
        if cancelled and task.cancelled():
            return None
        return task.result()

    def _extra(self, metrics: StepMetrics, dropped: dict[str, int], data: StepSamples) -> dict[str, float]:
        extra = {
            "grad_norm": metrics.grad_norm,
            "approx_kl": metrics.approx_kl,
            "ratio_mean": metrics.ratio_mean,
            "response_tokens": float(metrics.tokens),
            "skipped_updates": float(metrics.skipped_updates),
            "input_tokens": float(metrics.input_tokens),
            "computed_tokens": float(metrics.computed_tokens),
            "update_flops": float(metrics.flops),
            # run totals so far: groups the timeout policy dropped or kept partial, batches of unknown groups
            "dropped_groups_total": float(self.waiting.dropped_groups),
            "partial_groups_total": float(self.waiting.partial_groups),
            "ignored_batches_total": float(self.collector.ignored),
            "dropped_too_long": float(dropped["too_long"]),
            "dataset_passes": float(self.train.passes if self.train is not None else 0),
        }
        entropy = sampled_entropy(data.samples)
        if entropy is not None:
            extra["entropy"] = entropy
        if self.replay is not None:  # how many of the step's groups were replayed; the buffer's totals
            extra.update(
                replayed_groups=float(dropped["replayed"]),
                replay_passes=float(self.replay.passes),
                replay_rollouts=float(self.replay.rollouts),
                **{f"replay_refused_{k}": float(n) for k, n in self.replay.refused.items()},
            )
        if self.agents:  # per-agent adapters: what each agent's update did
            extra["dropped_other_agents"] = float(dropped["other_agents"])
            for agent, part in getattr(self.backend, "agent_metrics", {}).items():
                extra[f"agent_{agent}_loss"] = part.loss
                extra[f"agent_{agent}_tokens"] = float(part.tokens)
        # the off-policy correction's importance-weight statistics (is_weight_mean, ...), when one is in force
        extra.update({k: v for k, v in metrics.as_dict().items() if k.startswith("is_")})
        if self.options.dynamic_sampling:
            extra.update(
                filtered_groups=float(dropped["no_signal"]),
                filtered_groups_total=float(self.filtered_groups),
                dynamic_sampling_exhausted=float(dropped["exhausted"]),
            )
        if self.overlong is not None:
            extra["overlong_penalized"] = float(data.overlong_penalized)
        return extra

    def _train_step(
        self,
        number: int,
        groups: list[ClosedGroup],
        data: StepSamples,
        metrics: StepMetrics,
        extra: dict[str, float],
        *,
        waited: float,
        publish_s: float,
        stale: int,
    ) -> TrainStep:
        return TrainStep(
            run_id=self.options.run_id,
            step=number,
            model_version=number,
            num_transitions=len(data.samples),
            num_groups=len(groups),
            reward_mean=data.reward_mean,
            reward_std=data.reward_std,
            advantage_mean=data.advantage_mean,
            advantage_std=data.advantage_std,
            loss=metrics.loss,
            clip_fraction=min(max(metrics.clip_fraction, 0.0), 1.0),
            tokens_per_s=metrics.tokens_per_s,
            kl=metrics.kl if self.options.kl_coef > 0 else None,  # no reference model: no KL to report
            rollout_wait_s=max(waited, 0.0),
            train_s=metrics.train_s,
            publish_s=max(publish_s, 0.0),
            dropped_stale=stale,
            extra=extra,
            group_ids=[group.group_id for group in groups],
        )


def _replay_share(options: TrainSection, replay: ReplayBuffer | None, train: Dispatcher | None) -> int:
    """How many of a step's groups come from the replay buffer: all without a dataset, else ``replay_fraction``
    of ``groups_per_step`` (rounded; at least one when the fraction is above 0)."""
    if replay is None:
        return 0
    if train is None:
        return options.groups_per_step
    share = round(options.replay_fraction * options.groups_per_step)
    return max(share, 1) if options.replay_fraction > 0 else 0
