"""Sinks for Fulmen's JSON events: rollout lifecycle, transitions, model versions and training steps.

Each sink decodes one record into its event, turns events into rows of one table and builds the Arrow batch
with an explicit schema (so a type mismatch fails here, per record, not inside the store).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from aiokafka.structs import ConsumerRecord

from fulmen.schemas.codec import decode
from fulmen.schemas.ddl import TABLES
from fulmen.schemas.events import Event, ModelVersion, RolloutEvent, TrainStep, TransitionBatch
from fulmen.schemas.topics import TopicKey

__all__ = ["EVENT_SINKS", "EventSink", "model_version_rows", "rollout_rows", "train_step_rows", "transition_rows"]

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


ROLLOUT_SCHEMA = pa.schema([
    ("RolloutId", pa.string()), ("Attempt", pa.uint32()), ("TaskId", pa.string()), ("GroupId", pa.string()),
    ("Mode", pa.string()), ("Status", pa.string()), ("StatusRank", pa.uint8()), ("Reward", pa.float64()),
    ("Error", pa.string()), ("RunnerId", pa.string()), ("ModelVersion", pa.uint64()), ("Timestamp", _TS6),
])  # fmt: skip


def rollout_rows(event: RolloutEvent) -> list[dict[str, Any]]:
    return [{
        "RolloutId": event.rollout_id, "Attempt": event.attempt, "TaskId": event.task_id,
        "GroupId": event.group_id, "Mode": event.mode.value, "Status": event.status.value,
        "StatusRank": event.status.rank, "Reward": event.reward, "Error": event.error or "",
        "RunnerId": event.runner_id, "ModelVersion": event.model_version, "Timestamp": event.timestamp,
    }]  # fmt: skip


TRANSITION_SCHEMA = pa.schema([
    ("RolloutId", pa.string()), ("Attempt", pa.uint32()), ("TaskId", pa.string()), ("GroupId", pa.string()),
    ("Mode", pa.string()), ("Status", pa.string()), ("CallIndex", pa.uint32()), ("TraceId", pa.string()),
    ("SpanId", pa.string()), ("AgentName", pa.string()), ("ModelVersion", pa.uint64()),
    ("PromptTokenIds", pa.list_(pa.uint32())), ("ResponseTokenIds", pa.list_(pa.uint32())),
    ("ResponseLogprobs", pa.list_(pa.float32())), ("Reward", pa.float64()), ("IntermediateReward", pa.float64()),
    ("EpisodeReward", pa.float64()), ("CreatedAt", _TS6),
])  # fmt: skip


def transition_rows(batch: TransitionBatch) -> list[dict[str, Any]]:
    return [{
        "RolloutId": batch.rollout_id, "Attempt": batch.attempt, "TaskId": batch.task_id, "GroupId": batch.group_id,
        "Mode": batch.mode.value, "Status": batch.status.value, "CallIndex": t.index, "TraceId": t.trace_id,
        "SpanId": t.span_id, "AgentName": t.agent_name, "ModelVersion": t.model_version,
        "PromptTokenIds": t.prompt_token_ids, "ResponseTokenIds": t.response_token_ids,
        "ResponseLogprobs": t.response_logprobs or [], "Reward": t.reward,
        "IntermediateReward": t.intermediate_reward, "EpisodeReward": batch.episode_reward,
        "CreatedAt": batch.created_at,
    } for t in batch.transitions]  # fmt: skip


MODEL_VERSION_SCHEMA = pa.schema([
    ("ModelName", pa.string()), ("Version", pa.uint64()), ("Uri", pa.string()), ("Format", pa.string()),
    ("BaseModel", pa.string()), ("RunId", pa.string()), ("Step", pa.uint64()), ("CreatedAt", _TS6),
])  # fmt: skip


def model_version_rows(event: ModelVersion) -> list[dict[str, Any]]:
    return [{
        "ModelName": event.model_name, "Version": event.version, "Uri": event.uri, "Format": event.format,
        "BaseModel": event.base_model, "RunId": event.run_id, "Step": event.step, "CreatedAt": event.created_at,
    }]  # fmt: skip


TRAIN_STEP_SCHEMA = pa.schema([
    ("RunId", pa.string()), ("Step", pa.uint64()), ("ModelVersion", pa.uint64()), ("NumTransitions", pa.uint64()),
    ("NumGroups", pa.uint64()), ("RewardMean", pa.float64()), ("RewardStd", pa.float64()),
    ("AdvantageMean", pa.float64()), ("AdvantageStd", pa.float64()), ("Loss", pa.float64()),
    ("ClipFraction", pa.float64()), ("Kl", pa.float64()), ("TokensPerS", pa.float64()),
    ("RolloutWaitS", pa.float64()), ("TrainS", pa.float64()), ("PublishS", pa.float64()),
    ("DroppedStale", pa.uint64()), ("Extra", _ATTR_F64), ("CreatedAt", _TS6),
])  # fmt: skip


def train_step_rows(event: TrainStep) -> list[dict[str, Any]]:
    return [{
        "RunId": event.run_id, "Step": event.step, "ModelVersion": event.model_version,
        "NumTransitions": event.num_transitions, "NumGroups": event.num_groups, "RewardMean": event.reward_mean,
        "RewardStd": event.reward_std, "AdvantageMean": event.advantage_mean, "AdvantageStd": event.advantage_std,
        "Loss": event.loss, "ClipFraction": event.clip_fraction, "Kl": event.kl, "TokensPerS": event.tokens_per_s,
        "RolloutWaitS": event.rollout_wait_s, "TrainS": event.train_s, "PublishS": event.publish_s,
        "DroppedStale": event.dropped_stale, "Extra": list(event.extra.items()), "CreatedAt": event.created_at,
    }]  # fmt: skip


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
    )
}
