"""The transitions worker: terminal rollout events → offset barrier → spans from the store → TransitionBatches.

Lifecycle of the events of one poll (up to ``max_batch``):

1. decode each event (an undecodable one is dead-lettered); remember the highest attempt of each rollout;
2. keep the terminal events of the latest attempts (an older attempt's end, or a rollout attempt already built
   or waiting to be, is only acknowledged);
3. take the spans topic's end offsets and let the events wait for the spans consumer to commit past them
   (``barrier``); polling goes on meanwhile, and rounds are released in order;
4. take the released rollouts' spans from the span feed where it vouches for them (``feed``: the spans consumer
   of this process handed them over as it stored them), read the others' in one query (``reader``), and build
   one batch per rollout (``builder``); at most one such build per ``build_interval_s`` (a read of the store
   costs about the same for 50 rollouts or 500: it follows the table's parts, not the rollouts), so under load
   a build takes everything released meanwhile;
5. insert the transitions' rows into the transitions table, then publish the batches to
   ``fulmen.transitions`` keyed by group id, acknowledged;
6. commit the rollouts offsets once the batches are out *and* their late window has passed (``window``).

Late spans (``late``, or the feed for rollouts built while it covers the spans topic): a watched rollout that
received spans after its build is rebuilt from the store, and its batch inserted
and published again with a newer ``created_at`` (the transitions table keeps the newest row per call; readers
of the topic keep the newest batch of a rollout attempt); a WARNING says so.

Superseded attempts, end to end: a failed or timed-out attempt that will be retried has no reward and must
never reach training. The runner publishes ``queued`` for attempt N+1 *before* attempt N's terminal event (one
batch, same key, same partition; a runner taking over a lost attempt does the same), so when this worker reads
attempt N's end, :class:`~fulmen.consumers.transitions.window.AttemptTracker` already knows attempt N+1 and the end is
only acknowledged (``stats.superseded``): no rows in the transitions table, no batch on the topic, however long
the retry waits for a runner slot. An attempt N+1 that begins while N's event waits at the barrier supersedes
it too (checked again before building). Last line: the trainer's collector keeps only the latest attempt per
rollout (``fulmen.algorithm.service.groups``), for batches built before a later attempt was known (events from before
this rule, or a tracker that forgot the rollout).

Store or broker failures are retried with backoff until they succeed or ``stop`` is set; nothing is committed
past an event whose batch is not out. All of this runs in one task, so a rebalance (which runs inside the poll)
never meets a half-built round.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord, TopicPartition

from fulmen.consumers.barrier import OffsetBarrier, WaitingRounds
from fulmen.consumers.event_sinks import TRANSITION_SCHEMA, transition_rows
from fulmen.consumers.tracked import STORE_ERRORS, Fetched, TrackedWorker, WorkerStats
from fulmen.consumers.transitions.builder import BuildOptions, BuildResult, build_batch
from fulmen.consumers.transitions.feed import SpanFeed
from fulmen.consumers.transitions.late import LateSpanCheck
from fulmen.consumers.transitions.reader import RolloutKey, SpanReader
from fulmen.consumers.transitions.settings import TransitionsSection
from fulmen.consumers.transitions.window import AttemptTracker, BuildWindow, Built
from fulmen.infra.kafka.clients import close_quietly, start_or_raise
from fulmen.infra.kafka.dlq import DeadLetters
from fulmen.infra.kafka.publish import EventPublisher
from fulmen.infra.retry import STOPPED
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store
from fulmen.schemas.codec import decode, encode
from fulmen.schemas.ddl import TABLES
from fulmen.schemas.errors import PoisonInputError
from fulmen.schemas.events import RolloutEvent, RolloutStatus
from fulmen.schemas.topics import TopicKey, topic, topic_name

__all__ = ["TransitionStats", "TransitionWorker"]

log = logging.getLogger(__name__)

_MAX_WAITING_ROUNDS = 32  # pause fetching events while this many polls wait for the barrier
_MAX_CLAIMS = 200_000  # claimed events remembered (rollouts running), the oldest forgotten first
Item = tuple[TopicPartition, ConsumerRecord, RolloutEvent]


@dataclass
class TransitionStats(WorkerStats):
    batches: int = 0
    transitions: int = 0
    empty_batches: int = 0
    superseded: int = 0
    duplicates: int = 0
    late_rebuilds: int = 0
    skipped_calls: int = 0
    from_feed: int = 0  # rollouts built from the span feed
    from_store: int = 0  # rollouts built from spans read back from the store


class TransitionWorker(TrackedWorker):
    """Runs over a started consumer subscribed to the rollouts topic (with :meth:`listener`)."""

    name = "transitions"

    def __init__(
        self,
        sink: Any,
        settings: FulmenSettings,
        consumer: AIOKafkaConsumer,
        store: Store,
        dead_letters: DeadLetters,
        publisher: EventPublisher,
        barrier: OffsetBarrier,
        section: TransitionsSection,
        *,
        retry_backoff_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        feed: SpanFeed | None = None,
    ) -> None:
        self.window = BuildWindow()  # the offset tracker: an event is committed once its late window has passed
        super().__init__(
            sink,
            consumer,
            self.window,
            TransitionStats(),
            max_batch=section.max_batch,
            dead_letters=dead_letters,
            retry_backoff_s=retry_backoff_s,
            clock=clock,
            logger=log,
        )
        self.settings = settings
        self.store = store
        self.publisher = publisher
        self.barrier = barrier
        self.section = section
        self.options = BuildOptions.create(section.agent_pattern)
        self.reader = SpanReader(store)
        self.attempts = AttemptTracker()
        self.waiting = WaitingRounds(barrier.spans_group, section.barrier_timeout_s, clock)
        self.late = LateSpanCheck(self.reader, section.late_window_s, section.late_check_interval_s, clock)
        self.max_batch_bytes = int(topic(TopicKey.TRANSITIONS).config.get("max.message.bytes", 1024 * 1024))
        self._waiting_keys: set[RolloutKey] = set()
        self._next_build = 0.0  # the clock's time of the earliest next build (build_interval_s after the last)
        self.feed = feed
        self._claims: OrderedDict[RolloutKey, tuple[int, int]] = OrderedDict()  # (partition, offset) of claimed
        self._mark: tuple[int, dict[int, int]] | None = None  # (feed epoch, rollouts end offset per partition)
        self._build_epoch: int | None = None  # the feed's epoch when the last build took or read its spans

    async def start(self) -> None:
        await start_or_raise(self.publisher.broker, self.settings, "transitions publisher")
        await self.barrier.start()

    async def close(self) -> None:
        await self.barrier.stop()
        await close_quietly([self.publisher.broker])

    @property
    def feed_ready(self) -> bool:
        """Whether rollouts claimed from now on build from the span feed (it covers the spans topic, marked)."""
        return self.feed is not None and self._mark is not None and self._mark[0] == self.feed.epoch

    def full(self) -> bool:
        return len(self.waiting) >= _MAX_WAITING_ROUNDS

    def poll_ms(self) -> int:
        if not len(self.waiting):
            return 200
        return max(20, min(200, round(1000 * (self._next_build - self.clock()))))  # no sooner than the next build

    async def work(self, stop: asyncio.Event) -> None:
        """Release and build what the barrier lets through (at most one build per ``build_interval_s``); look for
        late spans when due."""
        if len(self.waiting) and self.clock() >= self._next_build:
            committed = await self.retrying(self.barrier.committed, "reading the spans group's offsets", stop)
            if committed is not STOPPED:
                ready = self.waiting.release(committed)
                if ready:
                    self._next_build = self.clock() + self.section.build_interval_s
                    await self._build_round(ready, stop)
        if self.late.due() and not stop.is_set():
            await self._check_late(stop)
        if self.feed is not None and not stop.is_set():
            await self._follow_feed(stop)

    async def _follow_feed(self, stop: asyncio.Event) -> None:
        """Tell the feed the spans topic's partitions; once it covers them all in a new epoch, take the mark: the
        rollouts topic's end offsets (a rollout claimed at or past them has all its spans in the feed)."""
        assert self.feed is not None
        partitions = await self.retrying(self.barrier.spans_partitions, "reading the spans topic's partitions", stop)
        if partitions is STOPPED:
            return
        self.feed.expect(partitions)
        if not self.feed.covering or (self._mark is not None and self._mark[0] == self.feed.epoch):
            return
        name = topic_name(TopicKey.ROLLOUTS, self.settings.kafka.topic_prefix)
        rollouts = self.consumer.partitions_for_topic(name)
        if not rollouts:
            return  # no metadata yet: next time
        epoch = self.feed.epoch
        ends = await self.retrying(
            lambda: self.barrier.end_offsets(name, rollouts), "reading the rollouts' end offsets", stop
        )
        if ends is not STOPPED:
            self._mark = (epoch, ends)
            log.info("transitions: the span feed covers the spans topic; rollouts claimed from %s build from it", ends)

    # --- reading events -------------------------------------------------------------------------------------
    async def take(self, fetched: Fetched, stop: asyncio.Event) -> None:
        items = []
        for tp, records in fetched.items():
            for record in records:
                item = await self._read(tp, record)
                if item is not None:
                    items.append(item)
        todo = [item for item in items if self._wanted(item)]  # after the whole poll was observed
        if not todo:
            return
        snapshot = await self.retrying(self.barrier.snapshot, "reading the spans topic's end offsets", stop)
        if snapshot is not STOPPED:
            self.waiting.add(todo, snapshot)

    async def _read(self, tp: TopicPartition, record: ConsumerRecord) -> Item | None:
        try:
            event = decode(
                RolloutEvent, record.value, topic=record.topic, partition=record.partition, offset=record.offset
            )
        except PoisonInputError as exc:
            await self.dead_letter(tp, record, exc)
            return None
        self.attempts.observe(event)
        if event.status is RolloutStatus.CLAIMED and self.feed is not None:
            self._claims[(event.rollout_id, event.attempt)] = (record.partition, record.offset)
            self.feed.want(event.rollout_id)
            if len(self._claims) > _MAX_CLAIMS:
                self._claims.popitem(last=False)
        if not event.status.terminal:
            self.done(tp, record.offset)
            return None
        return (tp, record, event)

    def _wanted(self, item: Item) -> bool:
        """Whether a terminal event is to be built: the latest attempt, not built or waiting already."""
        tp, record, event = item
        key = (event.rollout_id, event.attempt)
        if self.attempts.superseded(event):
            self.stats.superseded += 1
            self._forget_spans(key)
            log.info("rollout %s attempt %d superseded by a later attempt: not built", *key)
        elif self.window.has_built(key) or key in self._waiting_keys:
            self.stats.duplicates += 1
        else:
            self._waiting_keys.add(key)
            return True
        self.done(tp, record.offset)
        return False

    # --- building -------------------------------------------------------------------------------------------
    async def _build_round(self, released: list[Item], stop: asyncio.Event) -> None:
        items = []
        for tp, record, event in released:  # a later attempt may have begun while these waited
            if self.attempts.superseded(event):
                self.stats.superseded += 1
                self._waiting_keys.discard((event.rollout_id, event.attempt))
                self._forget_spans((event.rollout_id, event.attempt))
                self.done(tp, record.offset)
            else:
                items.append((tp, record, event))
        published = await self._build_and_publish(items, stop) if items else []
        if published is None:
            return  # stopped: nothing marked done, so nothing of this round is committed
        self._waiting_keys.difference_update((event.rollout_id, event.attempt) for _, _, event in items)
        ready_at = self.clock() + self.section.late_window_s
        for (tp, record, event), result in published:
            self.window.built(self._built(event, result, tp, record), ready_at)
        calls = sum(len(result.batch.transitions) for _, result in published)
        log.info("transitions: %d rollout(s) built, %d transition(s) published", len(published), calls)

    async def _build_and_publish(
        self, items: list[Item], stop: asyncio.Event, *, from_feed: bool = True
    ) -> list[tuple[Item, BuildResult]] | None:
        """Take (the feed) or read (the store), build, insert, publish; None when stopped first. Unbuildable events
        are dead-lettered."""
        keys = [(event.rollout_id, event.attempt) for _, _, event in items]
        self._build_epoch = self.feed.epoch if self.feed is not None and self.feed.covering else None
        spans = {key: found for key in keys if from_feed and (found := self._from_feed(key)) is not None}
        unfed = [key for key in keys if key not in spans]
        if unfed:
            for key in unfed:  # before the read: a span fed while it runs then shows as late, if the read missed it
                self._forget_spans(key)
            read = await self.retrying(lambda: asyncio.to_thread(self.reader.spans, unfed), "reading spans", stop)
            if read is STOPPED:
                return None
            spans |= read
        self.stats.from_feed += len(keys) - len(unfed)
        self.stats.from_store += len(unfed)
        built = []
        for item, key in zip(items, keys, strict=True):
            result = await self._build_one(item, spans.get(key, []))
            if result is not None:
                built.append((item, result))
        if built and not await self._publish([result for _, result in built], stop):
            return None
        return built

    async def _build_one(self, item: Item, spans: list) -> BuildResult | None:
        tp, record, event = item
        try:
            result = build_batch(event, spans, self.options)
            self._check_size(result)
        except (ValueError, PoisonInputError) as exc:
            error = exc if isinstance(exc, PoisonInputError) else PoisonInputError(f"cannot build: {exc}")
            log.error("rollout %s attempt %d: %s; dead-lettered", event.rollout_id, event.attempt, error.message)
            self.window.unwatch((event.rollout_id, event.attempt))
            self._forget_spans((event.rollout_id, event.attempt))
            await self.dead_letter(tp, record, error)
            return None
        for reason in result.skipped:
            log.warning("rollout %s attempt %d: call skipped: %s", event.rollout_id, event.attempt, reason)
        self.stats.skipped_calls += len(result.skipped)
        log.debug(
            "rollout %s attempt %d %s: %d spans, %d calls made, %d selected, %d grafted, %d rewards unmatched",
            event.rollout_id,
            event.attempt,
            event.status.value,
            result.span_count,
            result.calls_made,
            len(result.batch.transitions),
            result.grafted,
            result.unmatched_rewards,
        )
        return result

    def _check_size(self, result: BuildResult) -> None:
        """A batch over the topic's record limit can never be published: poison. Encoded only when an upper
        bound of its JSON size (ids <= 11 bytes, logprobs <= 25, 2 KB per call) comes close to the limit."""
        batch = result.batch
        bound = 4096 + sum(
            2048 + 11 * (len(t.prompt_token_ids) + len(t.response_token_ids)) + 25 * len(t.response_logprobs or ())
            for t in batch.transitions
        )
        if bound > self.max_batch_bytes and (size := len(encode(batch))) > self.max_batch_bytes:
            raise PoisonInputError(
                f"its TransitionBatch is {size} bytes, over the transitions topic's {self.max_batch_bytes}",
                rollout_id=batch.rollout_id,
            )

    async def _publish(self, results: list[BuildResult], stop: asyncio.Event) -> bool:
        """Rows into the transitions table, then the batches to Kafka (acknowledged); False when stopped."""
        await self.dead_letters.flush()
        rows = [row for result in results for row in transition_rows(result.batch)]
        if rows:
            table = pa.Table.from_pylist(rows, schema=TRANSITION_SCHEMA)
            inserted = await self.retrying(
                lambda: asyncio.to_thread(self.store.insert_arrow, TABLES["transitions"], table),
                "inserting transitions",
                stop,
            )
            if inserted is STOPPED:
                return False
        batches = [result.batch for result in results]
        sent = await self.retrying(
            lambda: self.publisher.publish_many(TopicKey.TRANSITIONS, batches), "publishing transitions", stop
        )
        if sent is STOPPED:
            return False
        self.stats.batches += len(batches)
        self.stats.transitions += len(rows)
        self.stats.empty_batches += sum(1 for batch in batches if not batch.transitions)
        return True

    # --- the span feed ------------------------------------------------------------------------------------
    def _from_feed(self, key: RolloutKey) -> list | None:
        """The spans of ``key`` from the feed when it vouches for all of them (``feed``: claimed at or past the
        mark of the epoch that still lasts, none dropped for room), else None: read them from the store."""
        claim = self._claims.pop(key, None)
        if self.feed is None or self._mark is None or claim is None or self._mark[0] != self.feed.epoch:
            return None
        partition, offset = claim
        if offset < self._mark[1].get(partition, math.inf):
            return None
        return self.feed.take(key)

    def _forget_spans(self, key: RolloutKey) -> None:
        if self.feed is not None:
            self.feed.discard(key)

    def _built(self, event: RolloutEvent, result: BuildResult, tp: TopicPartition, record: ConsumerRecord) -> Built:
        """What the window watches; ``feed_epoch`` when the feed has covered the spans topic since the build took
        or read its spans (an epoch that began meanwhile dropped what arrived before it): late spans show there."""
        same = self.feed is not None and self.feed.covering and self.feed.epoch == self._build_epoch
        return Built(
            event,
            result.span_count,
            result.batch.created_at,
            tp,
            record,
            feed_epoch=self._build_epoch if same else None,
        )

    # --- late spans -----------------------------------------------------------------------------------------
    async def _check_late(self, stop: asyncio.Event) -> None:
        watched = self.window.watched()
        fed = {key for key, built in watched.items() if self._fed_since_build(built)}
        late = [key for key in fed if self.feed is not None and self.feed.arrived(key)]
        unfed = {key: built for key, built in watched.items() if key not in fed}
        if unfed:
            try:
                late += list(await asyncio.to_thread(self.late.late, unfed))
            except STORE_ERRORS as exc:
                log.warning("transitions: the late-span check failed, trying again next time: %s", exc)
        if not late:
            return
        before = {key: watched[key].span_count for key in late}
        items = [(watched[key].tp, watched[key].record, watched[key].event) for key in late]
        published = await self._build_and_publish(items, stop, from_feed=False)
        if published is None:
            return
        ready_at = self.clock() + self.section.late_window_s
        for (tp, record, event), result in published:
            key = (event.rollout_id, event.attempt)
            log.warning(
                "rollout %s attempt %d: %d span(s) arrived after its transitions were built; rebuilt with %d "
                "transition(s) and published again",
                key[0],
                key[1],
                result.span_count - before[key],
                len(result.batch.transitions),
            )
            self.window.built(self._built(event, result, tp, record), ready_at)
        self.stats.late_rebuilds += len(published)

    def _fed_since_build(self, built: Built) -> bool:
        """Whether the feed has covered the spans topic since ``built``'s build, so its late spans show there."""
        return self.feed is not None and built.feed_epoch == self.feed.epoch and self.feed.covering

    def forget(self, partitions: list[TopicPartition]) -> None:
        for _, _, event in self.waiting.drop(lambda item: item[0] not in partitions):
            self._waiting_keys.discard((event.rollout_id, event.attempt))
