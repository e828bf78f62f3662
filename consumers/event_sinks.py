"""Sinks for Fulmen's JSON events: rollout lifecycle, transitions, model versions, training steps and the dispatched
tasks.

Each sink decodes one record into its event, turns events into rows of one table and builds the Arrow batch
with an explicit schema (so a type mismatch fails here, per record, not inside the store).

The sinks run as faststream batch subscribers (:func:`subscribe`, :class:`SinkHandler`), one consumer group
each, with an explicit acknowledgement policy: ``AckPolicy.MANUAL``, never faststream's auto-commit default. A
batch is one poll (up to ``max_records`` records, the broker holding the fetch up to ``max_wait_s`` for more).
Its handler takes the records' raw bytes and, in this order: decodes each record (one that is poison goes to
the dead-letter topic on its own, the rest of the batch goes on), inserts the batch into the store as one Arrow
table (retried with backoff while the store is down, never skipped), waits until the dead-letter topic
acknowledged what was sent there, and only then commits the batch's offsets. If anything fails before the
commit, the handler rewinds each partition to the batch's first offset so the same records come again (a
batch that was inserted twice is made invisible by the tables' ReplacingMergeTree keys): at-least-once, like
:class:`~fulmen.consumers.batch.BatchConsumer`. faststream runs one handler at a time per subscriber, so a
batch's insert does not overlap the next poll as in the batch consumer, which these topics (one event per
rollout or step) do not need; the spans sink stays on the batch consumer (see :mod:`fulmen.infra.kafka.broker`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from aiokafka.errors import IllegalStateError
from aiokafka.structs import ConsumerRecord, TopicPartition
from faststream.kafka import KafkaBroker, KafkaRouter
from faststream.kafka.annotations import KafkaMessage
from faststream.middlewares import AckPolicy

from fulmen.consumers.batch import BatchStats
from fulmen.consumers.metrics import observe_batch
from fulmen.infra.kafka.broker import endpoint_title, provisioned, subscriber_options
from fulmen.infra.kafka.dlq import DeadLetters
from fulmen.infra.kafka.offsets import commit_offsets, describe_offsets
from fulmen.infra.retry import backoff_s, retrying
from fulmen.infra.store import Store
from fulmen.schemas.codec import decode
from fulmen.schemas.ddl import TABLES
from fulmen.schemas.errors import PoisonInputError, RetryableError
from fulmen.schemas.events import (
    Event,
    ModelPromotion,
    ModelVersion,
    RolloutEvent,
    RolloutRequest,
    TrainStep,
    TransitionBatch,
)
from fulmen.schemas.prompts import PromptBundle, PromptPromotion
from fulmen.schemas.topics import TopicKey, topic

__all__ = [
    "EVENT_SINKS",
    "EventSink",
    "SinkHandler",
    "model_version_rows",
    "promotion_rows",
    "prompt_bundle_rows",
    "prompt_promotion_rows",
    "rollout_rows",
    "subscribe",
    "task_rows",
    "train_step_rows",
    "transition_rows",
]

log = logging.getLogger(__name__)

_TS6 = pa.timestamp("us", tz="UTC")
_ATTR_F64 = pa.map_(pa.string(), pa.float64())


@dataclass(frozen=True)
class EventSink:
    """A :class:`fulmen.consumers.batch.Sink` for one JSON event topic."""

    name: str
    topic: TopicKey
    table: str
    model: type[Event]
    rows: Callable[[Any], list[dict[str, Any]]]
    schema: pa.Schema

    def decode(self, record: ConsumerRecord) -> list[dict[str, Any]]:
        event = decode(self.model, record.value, topic=record.topic, partition=record.partition, offset=record.offset)
        return self.rows(event)

    def to_batch(self, units: Sequence[list[dict[str, Any]]]) -> pa.Table:
        return pa.Table.from_pylist([row for rows in units for row in rows], schema=self.schema)


ROLLOUT_SCHEMA = pa.schema(
    [
        ("RolloutId", pa.string()),
        ("Attempt", pa.uint32()),
        ("TaskId", pa.string()),
        ("GroupId", pa.string()),
        ("Mode", pa.string()),
        ("Status", pa.string()),
        ("StatusRank", pa.uint8()),
        ("Reward", pa.float64()),
        ("Error", pa.string()),
        ("RunnerId", pa.string()),
        ("ModelVersion", pa.uint64()),
        ("Timestamp", _TS6),
        ("PromptBundle", pa.string()),
    ]
)


def rollout_rows(event: RolloutEvent) -> list[dict[str, Any]]:
    return [
        {
            "RolloutId": event.rollout_id,
            "Attempt": event.attempt,
            "TaskId": event.task_id,
            "GroupId": event.group_id,
            "Mode": event.mode.value,
            "Status": event.status.value,
            "StatusRank": event.status.rank,
            "Reward": event.reward,
            "Error": event.error or "",
            "RunnerId": event.runner_id,
            "ModelVersion": event.model_version,
            "Timestamp": event.timestamp,
            "PromptBundle": event.prompt_bundle or "",
        }
    ]


TRANSITION_SCHEMA = pa.schema(
    [
        ("RolloutId", pa.string()),
        ("Attempt", pa.uint32()),
        ("TaskId", pa.string()),
        ("GroupId", pa.string()),
        ("Mode", pa.string()),
        ("Status", pa.string()),
        ("CallIndex", pa.uint32()),
        ("TraceId", pa.string()),
        ("SpanId", pa.string()),
        ("AgentName", pa.string()),
        ("ModelVersion", pa.uint64()),
        ("PromptTokenIds", pa.list_(pa.uint32())),
        ("ResponseTokenIds", pa.list_(pa.uint32())),
        ("ResponseLogprobs", pa.list_(pa.float32())),
        ("Reward", pa.float64()),
        ("IntermediateReward", pa.float64()),
        ("EpisodeReward", pa.float64()),
        ("CreatedAt", _TS6),
        ("PromptBundle", pa.string()),
    ]
)


def transition_rows(batch: TransitionBatch) -> list[dict[str, Any]]:
    return [
        {
            "RolloutId": batch.rollout_id,
            "Attempt": batch.attempt,
            "TaskId": batch.task_id,
            "GroupId": batch.group_id,
            "Mode": batch.mode.value,
            "Status": batch.status.value,
            "CallIndex": t.index,
            "TraceId": t.trace_id,
            "SpanId": t.span_id,
            "AgentName": t.agent_name,
            "ModelVersion": t.model_version,
            "PromptTokenIds": t.prompt_token_ids,
            "ResponseTokenIds": t.response_token_ids,
            "ResponseLogprobs": t.response_logprobs or [],
            "Reward": t.reward,
            "IntermediateReward": t.intermediate_reward,
            "EpisodeReward": batch.episode_reward,
            "CreatedAt": batch.created_at,
            "PromptBundle": t.prompt_bundle,
        }
        for t in batch.transitions
    ]


MODEL_VERSION_SCHEMA = pa.schema(
    [
        ("ModelName", pa.string()),
        ("Version", pa.uint64()),
        ("Uri", pa.string()),
        ("Format", pa.string()),
        ("BaseModel", pa.string()),
        ("RunId", pa.string()),
        ("Step", pa.uint64()),
        ("Adapter", pa.string()),
        ("CreatedAt", _TS6),
    ]
)


def model_version_rows(event: ModelVersion) -> list[dict[str, Any]]:
    return [
        {
            "ModelName": event.model_name,
            "Version": event.version,
            "Uri": event.uri,
            "Format": event.format,
            "BaseModel": event.base_model,
            "RunId": event.run_id,
            "Step": event.step,
            "Adapter": event.adapter,
            "CreatedAt": event.created_at,
        }
    ]


TASK_SCHEMA = pa.schema(
    [
        ("RolloutId", pa.string()),
        ("Attempt", pa.uint32()),
        ("TaskId", pa.string()),
        ("GroupId", pa.string()),
        ("Mode", pa.string()),
        ("Input", pa.string()),
        ("Metadata", pa.map_(pa.string(), pa.string())),
        ("ModelVersion", pa.uint64()),
        ("CreatedAt", _TS6),
    ]
)


def task_rows(request: RolloutRequest) -> list[dict[str, Any]]:
    return [
        {
            "RolloutId": request.rollout_id,
            "Attempt": request.attempt,
            "TaskId": request.task_id,
            "GroupId": request.group_id,
            "Mode": request.mode.value,
            "Input": json.dumps(request.input, ensure_ascii=False, separators=(",", ":")),
            "Metadata": list(request.metadata.items()),
            "ModelVersion": request.model_version,
            "CreatedAt": request.created_at,
        }
    ]


PROMOTION_SCHEMA = pa.schema(
    [
        ("ModelName", pa.string()),
        ("Adapter", pa.string()),
        ("Version", pa.uint64()),
        ("RunId", pa.string()),
        ("Action", pa.string()),
        ("Score", pa.float64()),
        ("ServingVersion", pa.uint64()),
        ("ServingScore", pa.float64()),
        ("Reason", pa.string()),
        ("Uri", pa.string()),
        ("BaseModel", pa.string()),
        ("CreatedAt", _TS6),
        ("HeldoutN", pa.uint32()),
        ("Gain", pa.float64()),
        ("GainLow", pa.float64()),
        ("GainHigh", pa.float64()),
        ("Confidence", pa.float64()),
        ("Margin", pa.float64()),
        ("Outcomes", pa.map_(pa.string(), pa.float64())),
    ]
)


def promotion_rows(event: ModelPromotion) -> list[dict[str, Any]]:
    model = event.model
    return [
        {
            "ModelName": model.model_name,
            "Adapter": model.adapter,
            "Version": model.version,
            "RunId": model.run_id,
            "Action": event.action.value,
            "Score": event.score,
            "ServingVersion": event.serving_version,
            "ServingScore": event.serving_score,
            "Reason": event.reason,
            "Uri": model.uri,
            "BaseModel": model.base_model,
            "CreatedAt": event.created_at,
            "HeldoutN": event.heldout_n,
            "Gain": event.gain,
            "GainLow": event.gain_low,
            "GainHigh": event.gain_high,
            "Confidence": event.confidence,
            "Margin": event.margin,
            "Outcomes": sorted(event.outcomes.items()),
        }
    ]


PROMPT_BUNDLE_SCHEMA = pa.schema(
    [
        ("BundleId", pa.string()),
        ("Slots", pa.map_(pa.string(), pa.string())),
        ("Templates", pa.map_(pa.string(), pa.string())),
        ("Parents", pa.list_(pa.string())),
        ("Scores", _ATTR_F64),
        ("Agent", pa.string()),
        ("Source", pa.string()),
        ("RunId", pa.string()),
        ("CreatedAt", _TS6),
    ]
)


def prompt_bundle_rows(bundle: PromptBundle) -> list[dict[str, Any]]:
    return [
        {
            "BundleId": bundle.bundle_id,
            "Slots": list(bundle.slots.items()),
            "Templates": list(bundle.templates.items()),
            "Parents": bundle.parents,
            "Scores": list(bundle.scores.items()),
            "Agent": bundle.agent,
            "Source": bundle.source,
            "RunId": bundle.run_id,
            "CreatedAt": bundle.created_at,
        }
    ]


PROMPT_PROMOTION_SCHEMA = pa.schema(
    [
        ("Agent", pa.string()),
        ("Action", pa.string()),
        ("BundleId", pa.string()),
        ("Previous", pa.string()),
        ("Reason", pa.string()),
        ("CreatedAt", _TS6),
    ]
)


def prompt_promotion_rows(event: PromptPromotion) -> list[dict[str, Any]]:
    return [
        {
            "Agent": event.agent or "",
            "Action": event.action.value,
            "BundleId": event.bundle_id,
            "Previous": event.previous,
            "Reason": event.reason,
            "CreatedAt": event.created_at,
        }
    ]


TRAIN_STEP_SCHEMA = pa.schema(
    [
        ("RunId", pa.string()),
        ("Step", pa.uint64()),
        ("ModelVersion", pa.uint64()),
        ("NumTransitions", pa.uint64()),
        ("NumGroups", pa.uint64()),
        ("RewardMean", pa.float64()),
        ("RewardStd", pa.float64()),
        ("AdvantageMean", pa.float64()),
        ("AdvantageStd", pa.float64()),
        ("Loss", pa.float64()),
        ("ClipFraction", pa.float64()),
        ("Kl", pa.float64()),
        ("TokensPerS", pa.float64()),
        ("RolloutWaitS", pa.float64()),
        ("TrainS", pa.float64()),
        ("PublishS", pa.float64()),
        ("DroppedStale", pa.uint64()),
        ("Extra", _ATTR_F64),
        ("GroupIds", pa.list_(pa.string())),
        ("CreatedAt", _TS6),
    ]
)


def train_step_rows(event: TrainStep) -> list[dict[str, Any]]:
    return [
        {
            "RunId": event.run_id,
            "Step": event.step,
            "ModelVersion": event.model_version,
            "NumTransitions": event.num_transitions,
            "NumGroups": event.num_groups,
            "RewardMean": event.reward_mean,
            "RewardStd": event.reward_std,
            "AdvantageMean": event.advantage_mean,
            "AdvantageStd": event.advantage_std,
            "Loss": event.loss,
            "ClipFraction": event.clip_fraction,
            "Kl": event.kl,
            "TokensPerS": event.tokens_per_s,
            "RolloutWaitS": event.rollout_wait_s,
            "TrainS": event.train_s,
            "PublishS": event.publish_s,
            "DroppedStale": event.dropped_stale,
            "Extra": list(event.extra.items()),
            "GroupIds": event.group_ids,
            "CreatedAt": event.created_at,
        }
    ]


EVENT_SINKS: dict[str, EventSink] = {
    sink.name: sink
    for sink in (
        EventSink("rollouts", TopicKey.ROLLOUTS, TABLES["rollouts"], RolloutEvent, rollout_rows, ROLLOUT_SCHEMA),
        EventSink(
            "transitions",
            TopicKey.TRANSITIONS,
            TABLES["transitions"],
            TransitionBatch,
            transition_rows,
            TRANSITION_SCHEMA,
        ),
        EventSink(
            "model_versions",
            TopicKey.MODELS,
            TABLES["model_versions"],
            ModelVersion,
            model_version_rows,
            MODEL_VERSION_SCHEMA,
        ),
        EventSink(
            "train_steps", TopicKey.METRICS, TABLES["train_steps"], TrainStep, train_step_rows, TRAIN_STEP_SCHEMA
        ),
        EventSink("tasks", TopicKey.TASKS, TABLES["tasks"], RolloutRequest, task_rows, TASK_SCHEMA),
        EventSink(
            "promotions", TopicKey.PROMOTIONS, TABLES["promotions"], ModelPromotion, promotion_rows, PROMOTION_SCHEMA
        ),
        EventSink(
            "prompt_bundles",
            TopicKey.PROMPTS,
            TABLES["prompt_bundles"],
            PromptBundle,
            prompt_bundle_rows,
            PROMPT_BUNDLE_SCHEMA,
        ),
        EventSink(
            "prompt_promotions",
            TopicKey.PROMPT_PROMOTIONS,
            TABLES["prompt_promotions"],
            PromptPromotion,
            prompt_promotion_rows,
            PROMPT_PROMOTION_SCHEMA,
        ),
    )
}


# --- running a sink on faststream ---------------------------------------------------------------------------------
_UNSTORABLE = (pa.ArrowException, OverflowError, ValueError, TypeError)


def subscribe(
    broker: KafkaBroker | KafkaRouter,
    sink: EventSink,
    group_id: str,
    *,
    max_records: int = 5000,
    max_wait_s: float = 0.5,
) -> Any:
    """Declare ``sink``'s batch subscriber on ``broker`` (the group ``group_id`` joined as is); attach a
    :class:`SinkHandler`'s :meth:`~SinkHandler.handler` to it before the broker starts."""
    return broker.subscriber(
        provisioned(topic(sink.topic).name),
        title=endpoint_title(f"consumers.{sink.name}", "receive", sink.topic),
        description=f"Inserts into the {sink.table} table; commits after the insert.",
        **subscriber_options(
            group_id=group_id, ack_policy=AckPolicy.MANUAL, max_records=max_records, max_wait_s=max_wait_s
        ),
    )


class SinkHandler:
    """Handles the batches of one :class:`EventSink`'s subscriber: decode, insert, flush dead letters, commit."""

    def __init__(
        self, sink: EventSink, store: Store, dead_letters: DeadLetters, *, retry_backoff_s: float = 0.5
    ) -> None:
        self.sink = sink
        self.store = store
        self.dead_letters = dead_letters
        self.retry_backoff_s = retry_backoff_s
        self.stats = BatchStats()
        self.consumer: Any = None  # the subscriber's consumer, once a batch came
        self._failures = 0

    def handler(self) -> Callable[..., Any]:
        """The function to attach to the subscriber (faststream injects the batch as ``message``)."""

        async def on_batch(message: KafkaMessage) -> None:
            await self.handle(message.raw_message, message.consumer)

        on_batch.__name__ = f"{self.sink.name}_batch"
        return on_batch

    async def handle(self, records: Sequence[ConsumerRecord], consumer: Any) -> None:
        """One batch, committed after its rows are inserted; on any failure rewound and raised."""
        self.consumer = consumer  # its partitions' lag is read from it (fulmen.consumers.metrics)
        try:
            units, kept = await self._decode(records)
            batch = await self._to_batch(units, kept) if units else None
            started = time.perf_counter()
            rows = await self._insert(batch) if batch is not None else 0
            observe_batch(self.sink.name, len(kept), started)
            await self.dead_letters.flush()
        except BaseException as exc:
            self._rewind(consumer, records)
            if isinstance(exc, Exception):
                self._failures += 1
                await asyncio.sleep(backoff_s(self._failures, self.retry_backoff_s))  # then faststream polls again
            raise
        self._failures = 0
        offsets = _next_offsets(records)
        committed = await commit_offsets(consumer, offsets, what=f"consumers: {self.sink.name}", logger=log)
        self.stats.batches += 1
        self.stats.records += len(kept)
        self.stats.rows += rows
        self.stats.last_batch_at = time.time()
        self.stats.committed.update(committed)
        log.info(
            "%s: batch of %d records (%d rows) into %s committed %s",
            self.sink.name,
            len(kept),
            rows,
            self.sink.table,
            describe_offsets(committed) or "nothing (rebalanced)",
        )

    async def _decode(self, records: Sequence[ConsumerRecord]) -> tuple[list[Any], list[ConsumerRecord]]:
        units, kept = [], []
        for record in records:
            try:
                units.append(self.sink.decode(record))
            except PoisonInputError as exc:
                exc.topic, exc.partition, exc.offset = record.topic, record.partition, record.offset
                await self._dead_letter(record, exc)
            else:
                kept.append(record)
        return units, kept

    async def _to_batch(self, units: list[Any], records: list[ConsumerRecord]) -> pa.Table:
        """The Arrow batch; when it cannot be built, record by record, the culprits dead-lettered."""
        try:
            return self.sink.to_batch(units)
        except _UNSTORABLE as batch_error:
            log.warning("%s: batch conversion failed (%s); converting record by record", self.sink.name, batch_error)
        good = []
        for unit, record in zip(units, records, strict=True):
            try:
                self.sink.to_batch([unit])
            except _UNSTORABLE as exc:
                await self._dead_letter(record, PoisonInputError(f"cannot store in {self.sink.table}: {exc}"))
            else:
                good.append(unit)
        return self.sink.to_batch(good)

    async def _insert(self, batch: pa.Table) -> int:
        return await retrying(  # no stop event: retried until the store takes it, never skipped
            lambda: asyncio.to_thread(self.store.insert_batch, self.sink.table, batch),
            what=f"{self.sink.name}: insert",
            retry_on=(RetryableError,),
            base_s=self.retry_backoff_s,
            logger=log,
        )

    async def _dead_letter(self, record: ConsumerRecord, error: PoisonInputError) -> None:
        await self.dead_letters.send(record, error)
        self.stats.dead_lettered += 1

    def _rewind(self, consumer: Any, records: Sequence[ConsumerRecord]) -> None:
        """Seek each partition back to the batch's first record, so the next poll reads the batch again."""
        for tp, offset in _first_offsets(records).items():
            try:
                consumer.seek(tp, offset)
            except IllegalStateError:  # revoked meanwhile: its new owner reads from the last commit
                log.debug("%s: %s[%d] no longer assigned; not rewound", self.sink.name, tp.topic, tp.partition)


def _first_offsets(records: Sequence[ConsumerRecord]) -> dict[TopicPartition, int]:
    first: dict[TopicPartition, int] = {}
    for record in records:
        tp = TopicPartition(record.topic, record.partition)
        first[tp] = min(first.get(tp, record.offset), record.offset)
    return first


def _next_offsets(records: Sequence[ConsumerRecord]) -> dict[TopicPartition, int]:
    """The offset after each partition's last record of the batch: what its commit says was read."""
    last: dict[TopicPartition, int] = {}
    for record in records:
        tp = TopicPartition(record.topic, record.partition)
        last[tp] = max(last.get(tp, record.offset), record.offset + 1)
    return last
