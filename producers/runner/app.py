"""``fulmen runner``: a consumer group over the tasks topic that runs the user's agent, rollout by rollout.

Lifecycle of a request (a record of the tasks topic):

1. Decide, after catching the ledger up to the rollouts topic's end: a new attempt is run; an attempt that
   already finished, or a stale copy of an older attempt, is only acknowledged; an attempt claimed by a
   runner that is still in the group is watched until it ends (that runner may be working on it after a
   rebalance); an attempt claimed by a runner that has left the group (killed) gets a new attempt number.
2. Run: publish ``claimed`` and ``running``; call the agent inside a ``fulmen.rollout`` span (every span the
   agent makes is stamped with the rollout), under the request's timeout; flush the spans.
3. Finish: if the attempt failed or timed out and attempts remain, publish the retry request (attempt + 1,
   with a not-before time: exponential backoff, ``fulmen.producers.runner.backoff``) first; then, in one batch on the
   rollouts topic, ``queued`` for attempt + 1 followed by the terminal event (``succeeded`` with the reward,
   ``failed``, ``timed_out``); only then is the record's offset committed (in offset order per partition,
   whatever order rollouts finish in).

Superseded attempts: because ``queued`` of the next attempt precedes a retried attempt's end on the rollouts
topic (same key, same partition), every reader of that topic knows the attempt is superseded when it sees its
end, however long the retry waits for a free slot: the transitions consumer never builds it (no rows in the
transitions table, no batch on ``fulmen.transitions``), so a failed attempt that is retried never reaches
training. A runner taking over a lost attempt publishes the same pair.

A retry whose not-before time has not come is held (not run, its offset not committed) while the runner runs
other requests; it starts when due and a slot is free, and goes to the new owner if its partition is taken away.

Sync agents run in a capped thread pool or, with ``FULMEN_RUNNER_SYNC_ISOLATION=process``, in a process per
rollout that is killed on timeout (``fulmen.producers.runner.sync``).

A runner killed at any point therefore loses nothing: the uncommitted request comes back to another runner,
which sees the lost claim and runs the next attempt. On SIGTERM the runner stops taking requests, lets the
running rollouts finish for ``shutdown_grace_s`` and hands the rest back uncommitted. Partitions are paused
(not left unpolled) while all slots are busy, so a long rollout never exceeds the poll interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Status, StatusCode

from fulmen.infra.kafka.admin import partition_count
from fulmen.infra.kafka.broker import kafka_broker
from fulmen.infra.kafka.clients import admin_client, close_quietly, consumer, consumer_group, producer, start_or_raise
from fulmen.infra.kafka.dlq import DeadLetters
from fulmen.infra.kafka.offsets import OffsetTracker, RebalanceListener, commit_finished
from fulmen.infra.kafka.publish import EventPublisher, Sender, Waves
from fulmen.infra.metrics import MetricsListener
from fulmen.producers.metrics import ROLLOUTS_FINISHED, ROLLOUTS_IN_FLIGHT, ROLLOUTS_RETRIED, ROLLOUTS_STARTED
from fulmen.producers.runner.agent import AgentError, LLMEndpoint, call_agent
from fulmen.producers.runner.backoff import DelayedRequests, hold_until, retry_delay_s, with_not_before
from fulmen.producers.runner.kafka_spans import KafkaSpanExporter
from fulmen.producers.runner.ledger import RolloutLedger
from fulmen.producers.runner.settings import RunnerSettings
from fulmen.producers.runner.sync import sync_caller
from fulmen.producers.runner.tracing import CURRENT_ROLLOUT, CoalescedFlush, ExportFailures, build_tracer_provider
from fulmen.schemas import semconv
from fulmen.schemas.codec import decode
from fulmen.schemas.errors import DecodeError
from fulmen.schemas.events import RolloutEvent, RolloutRequest, RolloutStatus, utc_now
from fulmen.schemas.topics import TopicKey, topic_name

__all__ = ["SENDER", "Runner"]

log = logging.getLogger(__name__)

SENDER = Sender("runner", (TopicKey.ROLLOUTS, TopicKey.TASKS))  # lifecycle events; a retry is a new task

_COMMIT_EVERY_S = 0.2
_HELD_PER_SLOT = 16  # retries held until their time, per slot, before the runner stops fetching more


@dataclass
class _Pending:
    tp: TopicPartition
    offset: int
    request: RolloutRequest
    held: bool = False  # held until its not-before time already (it is not held twice)


class Runner:
    """One runner process. Build it inside the event loop; :meth:`run` until ``stop`` is set."""

    def __init__(
        self,
        settings: RunnerSettings,
        agent: Callable[..., Any],
        tracer_provider: TracerProvider | None = None,
        export_failures: ExportFailures | None = None,
    ) -> None:
        """``export_failures``: where the exporters of ``tracer_provider`` note what they could not write (its
        own is made otherwise)."""
        self.settings = settings
        self.options = settings.runner
        self.agent = agent
        self.runner_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        prefix = settings.kafka.topic_prefix
        self.tasks_topic = topic_name(TopicKey.TASKS, prefix)
        # Lifecycle events are on the critical path of every rollout: no lingering on the producer, and short
        # broker-side fetch waits so that a freed slot or a catch-up is not held by a long poll.
        self.broker = kafka_broker(settings, linger_ms=0)
        self.producer = producer(settings, linger_ms=0)  # lifecycle events and dead letters
        self.publisher = EventPublisher(self.broker, SENDER, producer=self.producer)
        self.lifecycle = Waves(self.publisher, TopicKey.ROLLOUTS)  # rollouts finishing together: one send
        self.tasks = consumer(
            settings,
            self.options.group,
            client_id=self.runner_id,
            max_poll_records=self.options.concurrency,
            fetch_max_wait_ms=50,
        )
        self.ledger = RolloutLedger(
            consumer(settings, None, fetch_max_wait_ms=20), topic_name(TopicKey.ROLLOUTS, prefix)
        )
        self.dead_letters = DeadLetters(self.producer, prefix=prefix, consumer_group=self.options.group)
        self.span_producer: Any = None  # with span_export = kafka, made when the runner's provider exports
        self.span_exporter: KafkaSpanExporter | None = None
        kafka_spans = self._kafka_span_exporter if self.options.span_export == "kafka" else None
        self.export_failures = export_failures or ExportFailures()  # what its exporters could not write
        self.provider = tracer_provider or build_tracer_provider(
            self.options.otlp_endpoint or None, exporter=kafka_spans, failures=self.export_failures
        )
        self.tracer = self.provider.get_tracer("fulmen.runner")
        self.flusher = CoalescedFlush(self.provider)
        self.sync_agent = (
            None
            if inspect.iscoroutinefunction(agent)
            else sync_caller(
                self.options.sync_isolation,
                agent,
                self.options.agent,
                max_threads=self.options.max_sync_threads,
                otlp_endpoint=self.options.otlp_endpoint or None,
            )
        )
        self.running: dict[str, asyncio.Task[None]] = {}  # rollout id -> its task
        self.reporting: set[str] = set()  # of those, the ones whose agent is done (flushing and reporting)
        self.watching: list[_Pending] = []
        self.delayed: DelayedRequests[_Pending] = DelayedRequests()  # retries held until their not-before time
        self.max_held = _HELD_PER_SLOT * self.options.concurrency
        self.offsets = OffsetTracker()  # tasks records: committed in offset order, whatever order rollouts end in
        self.completed: dict[str, int] = {"succeeded": 0, "failed": 0, "timed_out": 0, "skipped": 0}
        self._fatal: BaseException | None = None
        self._slot_freed = asyncio.Event()
        self._committed_at = 0.0

    def _kafka_span_exporter(self) -> KafkaSpanExporter:
        """The exporter (and its producer) that writes in-process agents' spans into the spans topic."""
        prefix = self.settings.kafka.topic_prefix
        self.span_producer = producer(self.settings, linger_ms=0)  # a rollout's end waits for its spans: no lingering
        spans, feedback = topic_name(TopicKey.SPANS, prefix), topic_name(TopicKey.FEEDBACK, prefix)
        self.span_exporter = KafkaSpanExporter(self.span_producer, spans, feedback, failures=self.export_failures)
        return self.span_exporter

    # --- lifecycle ------------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        clients = [self.tasks, self.ledger.consumer, self.producer, self.broker]
        if self.span_producer is not None and self.span_exporter is not None:
            clients.append(self.span_producer)
            self.span_exporter.bind(asyncio.get_running_loop())
        metrics = MetricsListener.from_settings(self.settings.metrics, what=f"runner {self.runner_id}")
        try:
            if metrics is not None:
                await metrics.start()
            for client in reversed(clients):
                await start_or_raise(client, self.settings, f"runner {self.runner_id}")
            await self.ledger.start(await partition_count(self.settings, self.ledger.topic))
            self.tasks.subscribe([self.tasks_topic], listener=RebalanceListener(self, f"runner {self.runner_id}"))
            log.info(
                "runner %s: %s with %d slots on %s",
                self.runner_id,
                self.options.agent or "agent",
                self.options.concurrency,
                self.tasks_topic,
            )
            while not stop.is_set():
                await self.poll_once()
            await self._shutdown()
        finally:
            if self.span_exporter is not None:
                self.span_exporter.shutdown()  # every rollout flushed its spans before its end was reported
            await close_quietly(clients)
            if self.sync_agent is not None:
                self.sync_agent.close()
            if metrics is not None:
                await metrics.stop()

    async def _shutdown(self) -> None:
        if self.tasks.assignment():
            self.tasks.pause(*self.tasks.assignment())
        if self.running:
            log.info(
                "runner %s: finishing %d rollouts (up to %.0fs)",
                self.runner_id,
                len(self.running),
                self.options.shutdown_grace_s,
            )
            _, late = await asyncio.wait(list(self.running.values()), timeout=self.options.shutdown_grace_s or None)
            for task in late:
                task.cancel()  # handed back: its offset stays uncommitted, another runner takes it
            if late:
                await asyncio.wait(late)
        await self._commit()

    # --- the loop -------------------------------------------------------------------------------------------
    async def poll_once(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        free = self._free_slots()
        if free > 0 and self.delayed:
            await self._start_due(free)
            free = self._free_slots()
        room = min(free, self.max_held - len(self.delayed))  # held retries bound what is fetched
        assigned = self.tasks.assignment()
        if assigned and room <= 0:
            # Full: wait for a rollout to end (or a held retry's time) rather than poll (the group's heartbeat
            # runs on its own).
            self.tasks.pause(*assigned)
            self._slot_freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._slot_freed.wait(), self._wait_s(0.5))
            await self._commit(every_s=_COMMIT_EVERY_S)
            return
        if assigned:
            self.tasks.resume(*assigned)
        fetched = await self.tasks.getmany(timeout_ms=round(self._wait_s(0.5) * 1000), max_records=max(room, 1))
        if fetched or self.watching:
            await self.ledger.catch_up()
        if self.watching:
            watched, self.watching = self.watching, []
            for pending in watched:
                await self._decide_and_start(pending)
        for tp, records in fetched.items():
            for record in records:
                self.offsets.read(tp, record.offset)
                await self._take(tp, record)
        await self._commit(every_s=_COMMIT_EVERY_S)

    def _free_slots(self) -> int:
        # A slot is an agent at work: a rollout that only reports its end (flush, terminal event) does not hold
        # one, up to as many reporting as there are slots (so a slow broker still pushes back).
        in_agents = len(self.running) - len(self.reporting)
        return self.options.concurrency - in_agents - max(0, len(self.reporting) - self.options.concurrency)

    def _wait_s(self, longest: float) -> float:
        """How long the loop may wait: ``longest``, or less when a held retry comes due sooner."""
        next_at = self.delayed.next_at
        if next_at is None:
            return longest
        until = (next_at - utc_now()).total_seconds()
        return longest if until <= 0 else min(longest, max(until, 0.001))  # due ones wait for a slot

    async def _start_due(self, free: int) -> None:
        """Start up to ``free`` held retries whose time has come, deciding on what the rollouts topic says now."""
        due = self.delayed.pop_due(utc_now(), free)
        if not due:
            return
        await self.ledger.catch_up()
        for pending in due:
            await self._decide_and_start(pending)

    async def _take(self, tp: TopicPartition, record: ConsumerRecord) -> None:
        try:
            request = decode(
                RolloutRequest, record.value, topic=record.topic, partition=record.partition, offset=record.offset
            )
        except DecodeError as exc:
            await self.dead_letters.send(record, exc)
            await self.dead_letters.flush()
            self._finish(tp, record.offset)
            return
        await self._decide_and_start(_Pending(tp, record.offset, request))

    async def _decide_and_start(self, pending: _Pending) -> None:
        request = pending.request
        state = self.ledger.get(request.rollout_id)
        queued = state is not None and state.attempt == request.attempt and state.status is RolloutStatus.QUEUED
        if state is None or state.attempt < request.attempt or queued:
            self._start_when_due(pending, request)
        elif state.attempt > request.attempt or state.status.terminal:
            self.completed["skipped"] += 1  # an older attempt's copy, or an attempt that already ended
            self._finish(pending.tp, pending.offset)
        elif request.rollout_id in self.running or await self._alive(state.runner_id):
            self.watching.append(pending)  # someone (maybe us, before a rebalance) still works on it
        else:
            await self._take_over(pending, state.attempt, state.runner_id)

    async def _take_over(self, pending: _Pending, lost_attempt: int, lost_runner: str) -> None:
        """The runner that claimed this attempt has left the group (killed): end that attempt, run the next."""
        request = pending.request
        error = f"runner {lost_runner} was lost during attempt {lost_attempt}"
        lost = self._event(request.model_copy(update={"attempt": lost_attempt}), RolloutStatus.FAILED, error=error)
        if lost_attempt >= request.max_attempts:
            await self._publish_event(lost.model_copy(update={"error": f"{error}; no attempts left"}))
            self._finish(pending.tp, pending.offset)
            return
        log.warning("rollout %s: %s; running attempt %d", request.rollout_id, error, lost_attempt + 1)
        retry = request.model_copy(update={"attempt": lost_attempt + 1})
        await self._publish_events(self._event(retry, RolloutStatus.QUEUED), lost)  # superseded before it ends
        self._start(pending, retry)

    def _start_when_due(self, pending: _Pending, request: RolloutRequest) -> None:
        """Start now, or hold a retry until its not-before time (at most the longest backoff from now)."""
        if not pending.held:
            until = hold_until(request, utc_now(), self.options.longest_retry_wait_s)
            if until is not None:
                pending.held = True
                self.delayed.push(pending, until)
                log.debug("rollout %s attempt %d held until %s", request.rollout_id, request.attempt, until)
                return
        self._start(pending, request)

    def _start(self, pending: _Pending, request: RolloutRequest) -> None:
        task = asyncio.create_task(self._run_rollout(pending, request), name=f"rollout-{request.rollout_id}")
        self.running[request.rollout_id] = task
        task.add_done_callback(lambda done: self._ended(request.rollout_id, done))

    def _ended(self, rollout_id: str, task: asyncio.Task[None]) -> None:
        if self.running.get(rollout_id) is task:  # not a later attempt of the rollout started meanwhile
            self.running.pop(rollout_id)
            self.reporting.discard(rollout_id)
        self._slot_freed.set()
        if not task.cancelled() and task.exception() is not None and self._fatal is None:
            # Kafka refused an event for good: stop, so the uncommitted request comes back after a restart,
            # rather than keep a partition whose commits can no longer move.
            self._fatal = task.exception()

    # --- one rollout ----------------------------------------------------------------------------------------
    async def _run_rollout(self, pending: _Pending, request: RolloutRequest) -> None:
        # One round trip for both (same key, same partition: they stay in order).
        await self._publish_events(
            self._event(request, RolloutStatus.CLAIMED), self._event(request, RolloutStatus.RUNNING)
        )
        ROLLOUTS_STARTED.inc()
        ROLLOUTS_IN_FLIGHT.inc()
        try:
            status, reward, error = await self._call(request)
        finally:
            ROLLOUTS_IN_FLIGHT.dec()
        self.reporting.add(request.rollout_id)  # the agent's slot is free for the next request
        self._slot_freed.set()
        await self.flusher.flush()  # the spans are out before the end is reported
        lost = self.export_failures.take(request.rollout_id, request.attempt)
        if lost is not None and status is RolloutStatus.SUCCEEDED:  # never trained on with spans missing
            status, reward, error = RolloutStatus.FAILED, None, f"some of its spans were not exported: {lost}"
            log.warning("rollout %s attempt %d: %s", request.rollout_id, request.attempt, error)
        ended = self._event(request, status, reward=reward, error=error)
        if status is not RolloutStatus.SUCCEEDED and request.attempt < request.max_attempts:
            retry = self._retry_of(request, utc_now())
            await self.publisher.publish(TopicKey.TASKS, retry)
            ROLLOUTS_RETRIED.inc()
            # queued(attempt + 1) before this attempt's end: readers know it is superseded when they see its end
            await self._publish_events(self._event(retry, RolloutStatus.QUEUED), ended)
        else:
            await self._publish_event(ended)
        self.completed[status.value] += 1
        ROLLOUTS_FINISHED.labels(status.value).inc()
        log.info("rollout %s attempt %d %s (reward %s)", request.rollout_id, request.attempt, status.value, reward)
        self._finish(pending.tp, pending.offset)

    def _retry_of(self, request: RolloutRequest, now: datetime) -> RolloutRequest:
        """The next attempt's request, not to start before the backoff after ``now``."""
        retry = request.model_copy(update={"attempt": request.attempt + 1})
        opts = self.options
        delay = retry_delay_s(request.attempt, opts.retry_backoff_s, opts.retry_backoff_max_s, opts.retry_jitter)
        if delay <= 0:
            return retry
        log.info("rollout %s: attempt %d in %.1fs at the earliest", request.rollout_id, retry.attempt, delay)
        return with_not_before(retry, now + timedelta(seconds=delay))

    async def _call(self, request: RolloutRequest) -> tuple[RolloutStatus, float | None, str | None]:
        # the rollout's scope in the gateway's path: its id and attempt, its sampling seed and the prompt bundle it
        # names (if any)
        scope = f"/rollout/{request.rollout_id}/attempt/{request.attempt}"
        if request.seed is not None:
            scope += f"/seed/{request.seed}"
        if request.prompt_bundle is not None:
            scope += f"/bundle/{request.prompt_bundle}"
        llm = LLMEndpoint(
            base_url=f"{self.options.llm_base_url.rstrip('/')}{scope}/v1",
            model=self.options.model,
            api_key=self.options.llm_api_key.get_secret_value(),
        )
        token = CURRENT_ROLLOUT.set(request)
        try:
            with self.tracer.start_as_current_span(semconv.SPAN_ROLLOUT, record_exception=False) as span:
                try:
                    reward = await asyncio.wait_for(self._invoke(request.input, llm), request.timeout_s)
                except TimeoutError:
                    span.set_status(Status(StatusCode.ERROR, "timed out"))
                    return RolloutStatus.TIMED_OUT, None, f"no result within {request.timeout_s:g}s"
                except AgentError as exc:
                    span.set_status(Status(StatusCode.ERROR, str(exc)))
                    return RolloutStatus.FAILED, None, str(exc)
                if reward is not None:
                    span.set_attribute(semconv.REWARD_VALUE, reward)
                return RolloutStatus.SUCCEEDED, reward, None
        finally:
            CURRENT_ROLLOUT.reset(token)

    async def _invoke(self, task: dict[str, Any], llm: LLMEndpoint) -> float | None:
        if self.sync_agent is None:
            return await call_agent(self.agent, task, llm)
        return await self.sync_agent.call(task, llm)

    def _event(self, request: RolloutRequest, status: RolloutStatus, **fields: Any) -> RolloutEvent:
        return RolloutEvent(
            rollout_id=request.rollout_id,
            attempt=request.attempt,
            status=status,
            task_id=request.task_id,
            group_id=request.group_id,
            mode=request.mode,
            runner_id=self.runner_id,
            model_version=request.model_version,
            prompt_bundle=request.prompt_bundle,
            **fields,
        )

    async def _publish_event(self, event: RolloutEvent) -> None:
        await self._publish_events(event)

    async def _publish_events(self, *events: RolloutEvent) -> None:
        await self.lifecycle.publish_many(events)
        for event in events:
            self.ledger.observe(event)

    # --- offsets and liveness -------------------------------------------------------------------------------
    def _finish(self, tp: TopicPartition, offset: int) -> None:
        self.offsets.done(tp, offset)  # ignored when the partition was revoked meanwhile (its new owner redoes it)

    async def _commit(self, every_s: float = 0.0, partitions: list[TopicPartition] | None = None) -> None:
        """Commit what is finished (of ``partitions``, or all); with ``every_s``, at most that often (a commit is
        a broker round trip on the poll loop; a request redelivered after a crash whose rollout already ended is
        only acknowledged). A commit refused by a rebalance is logged and dropped (``commit_finished``)."""
        now = time.monotonic()
        if every_s and now - self._committed_at < every_s:
            return
        self._committed_at = now
        await commit_finished(
            self.tasks, self.offsets, what=f"runner {self.runner_id}", partitions=partitions, logger=log
        )

    async def _alive(self, runner_id: str) -> bool:
        """Whether the runner that claimed an attempt is still a member of the runners' group."""
        if runner_id == self.runner_id:
            return True
        admin = admin_client(self.settings)
        await start_or_raise(admin, self.settings, "group membership")
        try:
            groups = await admin.describe_consumer_groups([consumer_group(self.settings, self.options.group)])
        finally:
            await admin.close()
        members = {m[1] for response in groups for group in response.groups for m in group[5]}
        return runner_id in members

    # --- rebalances (``RebalanceListener``) ------------------------------------------------------------------
    async def revoked(self, partitions: list[TopicPartition]) -> None:
        """Partitions taken away: commit what is finished of them, then forget them."""
        await self._commit(partitions=partitions)
        self.forget(partitions)

    def assigned(self, partitions: list[TopicPartition]) -> None:
        """Partitions given: they are read from their committed offset, so anything known of them is stale."""
        self.forget(partitions)

    def forget(self, partitions: list[TopicPartition]) -> None:
        """Partitions taken away: their uncommitted records go to the new owner (running rollouts go on)."""
        self.offsets.forget(partitions)
        self.watching = [p for p in self.watching if p.tp not in partitions]
        self.delayed.drop(lambda pending: pending.tp in partitions)
