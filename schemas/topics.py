"""The Kafka topics: names, keys, value contracts, partition counts and settings.

The names here are defaults. A deployment can add a prefix (``FULMEN_KAFKA_TOPIC_PREFIX``) to run several
Fulmen installations, or test sessions, on one cluster; resolve names with :func:`topic_name`. Nothing else
may spell a topic name.

Consumer groups take the same prefix, so two deployments that share a cluster by prefix never share a group:
Fulmen's own group ids (:data:`GROUPS`, and the per-sink groups under ``fulmen.consumers.``) are resolved with
:func:`group_name`, which :func:`fulmen.infra.kafka.clients.consumer` applies to every group it joins. A group id
outside Fulmen's names (one set explicitly, e.g. ``FULMEN_RUNNER_GROUP=my-runners``) is used as given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from fulmen.schemas.events import (
    Event,
    Feedback,
    ModelPromotion,
    ModelVersion,
    RolloutEvent,
    RolloutRequest,
    TrainStep,
    TransitionBatch,
)
from fulmen.schemas.prompts import PromptBundle, PromptPromotion

__all__ = [
    "GROUPS",
    "MIN_INSYNC_REPLICAS",
    "TOPICS",
    "GroupKey",
    "Topic",
    "TopicKey",
    "group_name",
    "min_insync_replicas",
    "topic",
    "topic_name",
]


class TopicKey(StrEnum):
    """Stable handles for the topics, independent of their (configurable) names."""

    TASKS = "tasks"
    SPANS = "spans"
    ROLLOUTS = "rollouts"
    TRANSITIONS = "transitions"
    MODELS = "models"
    METRICS = "metrics"
    FEEDBACK = "feedback"
    PROMOTIONS = "promotions"
    PROMPTS = "prompts"
    PROMPT_PROMOTIONS = "prompt_promotions"
    DLQ = "dlq"


_DAY_MS = 24 * 3600 * 1000

MIN_INSYNC_REPLICAS = 2
"""``min.insync.replicas`` of every Fulmen topic replicated 3 times or more.

Every one of the topics carries data that exists nowhere else once Kafka acknowledged it: the spans (the gateway
answered 200, the agent dropped its copy), the tasks (a lost request is a rollout never run), the rollouts (the
rewards), the transitions (what the trainer learns from), the models (which checkpoint is current: the gateways
follow it), the metrics (the training history; the store's ``train_steps`` is materialised from it), the feedback
(rewards sent after the fact: the gateway answered 202) and the dead letters (the only record of why an input was
refused, kept longer than its source). Producers write with ``acks=all``: with 3 replicas and 2 in sync an
acknowledged record is on two machines, and losing one node keeps every topic writable. Fewer than 3 replicas keep
the cluster's default (1 on a single broker: writable at all)."""


def min_insync_replicas(replication_factor: int) -> int | None:
    """The ``min.insync.replicas`` Fulmen sets on a topic with ``replication_factor`` replicas (None: leave the
    cluster's default)."""
    return MIN_INSYNC_REPLICAS if replication_factor >= 3 else None


@dataclass(frozen=True)
class Topic:
    """One topic and what it carries.

    ``value`` is the pydantic contract of the record value, or None when the value is not one of ours (OTLP
    protobuf on the spans topic; the original bytes on the dead-letter topic).
    """

    key: TopicKey
    name: str
    record_key: str
    value: type[Event] | None
    value_format: str
    partitions: int
    config: dict[str, str] = field(default_factory=dict)
    description: str = ""
    producers: tuple[str, ...] = ()
    consumers: tuple[str, ...] = ()


TOPICS: dict[TopicKey, Topic] = {
    t.key: t
    for t in (
        Topic(
            TopicKey.TASKS,
            "fulmen.tasks",
            "rollout_id",
            RolloutRequest,
            "json",
            8,
            {"retention.ms": str(7 * _DAY_MS)},
            "Rollout requests; consumed by the runners' consumer group.",
            ("fulmen submit", "algorithm dispatcher", "runner (retries)"),
            ("runner",),
        ),
        Topic(
            TopicKey.SPANS,
            "otlp_spans",
            "trace_id",
            None,
            "otlp_proto",
            8,
            {"retention.ms": str(3 * _DAY_MS), "max.message.bytes": str(8 * 1024 * 1024)},
            "OTLP ExportTraceServiceRequest protobuf, as the OpenTelemetry Collector's Kafka exporter writes.",
            ("otlp-gateway", "llm-gateway", "runner", "OpenTelemetry Collector"),
            ("consumers: spans", "consumers: production"),
        ),
        Topic(
            TopicKey.ROLLOUTS,
            "fulmen.rollouts",
            "rollout_id",
            RolloutEvent,
            "json",
            8,
            {"retention.ms": str(7 * _DAY_MS)},
            "Rollout lifecycle events (claimed, running, succeeded, failed, timed out); the end of each production "
            "episode (an agent Fulmen does not run, grouped by trace).",
            ("runner", "fulmen submit", "consumers: production"),
            ("consumers: rollouts", "consumers: transitions"),
        ),
        Topic(
            TopicKey.TRANSITIONS,
            "fulmen.transitions",
            "group_id",
            TransitionBatch,
            "json",
            4,
            {"retention.ms": str(7 * _DAY_MS), "max.message.bytes": str(8 * 1024 * 1024)},
            "One TransitionBatch per finished rollout; consumed by the algorithm.",
            ("consumers: transitions",),
            ("algorithm collector", "consumers: transitions table"),
        ),
        Topic(
            TopicKey.MODELS,
            "fulmen.models",
            "topic_key",
            ModelVersion,
            "json",
            1,
            {"cleanup.policy": "compact", "min.compaction.lag.ms": "0"},
            "Model versions; compacted, so the latest of each model (and of each agent's adapter) is there to read.",
            ("algorithm trainer",),
            ("llm-gateway", "consumers: model_versions"),
        ),
        Topic(
            TopicKey.METRICS,
            "fulmen.metrics",
            "run_id",
            TrainStep,
            "json",
            1,
            {"retention.ms": str(30 * _DAY_MS)},
            "Training step metrics.",
            ("algorithm trainer",),
            ("consumers: train_steps",),
        ),
        Topic(
            TopicKey.FEEDBACK,
            "fulmen.feedback",
            "target_id",
            Feedback,
            "json",
            8,
            {"retention.ms": str(7 * _DAY_MS)},
            "Rewards sent after the fact for an LLM call, a rollout or a trace; resolved into the feedback table.",
            ("llm-gateway", "fulmen feedback"),
            ("consumers: feedback",),
        ),
        Topic(
            TopicKey.PROMOTIONS,
            "fulmen.promotions",
            "topic_key",
            ModelPromotion,
            "json",
            1,
            {"cleanup.policy": "compact", "min.compaction.lag.ms": "0"},
            "Which version of each model serves (promote, rollback) and the candidates a gated run rejected; "
            "compacted, so the version in force is there to read.",
            ("algorithm trainer (--promote-if-better)", "fulmen models"),
            ("llm-gateway (FOLLOW=promoted)", "consumers: promotions"),
        ),
        # Bundles are immutable and keyed by their content hash: compaction never drops one (no key repeats), so the
        # topic is the registry of every bundle. Promotions get a topic of their own, keyed by agent scope, because
        # compaction must keep the LATEST promotion per scope while keeping EVERY bundle, and one topic carries one
        # contract (its sink, its followers); the gateway follows both from their beginnings.
        Topic(
            TopicKey.PROMPTS,
            "fulmen.prompts",
            "topic_key",
            PromptBundle,
            "json",
            1,
            {"cleanup.policy": "compact", "min.compaction.lag.ms": "0"},
            "Prompt bundles (slot texts, lineage, scores), keyed by their content hash; compacted, so every bundle "
            "stays there to read.",
            ("fulmen prompts create", "fulmen optimize-prompt"),
            ("llm-gateway", "consumers: prompt_bundles"),
        ),
        Topic(
            TopicKey.PROMPT_PROMOTIONS,
            "fulmen.prompt_promotions",
            "topic_key",
            PromptPromotion,
            "json",
            1,
            {"cleanup.policy": "compact", "min.compaction.lag.ms": "0"},
            "Which prompt bundle serves the calls that name none, per agent scope (promote, rollback); compacted, so "
            "the bundle in force per scope is there to read.",
            ("fulmen prompts promote|rollback", "fulmen optimize-prompt"),
            ("llm-gateway", "consumers: prompt_promotions"),
        ),
        Topic(
            TopicKey.DLQ,
            "fulmen.dlq",
            "original key",
            None,
            "original bytes",
            1,
            {"retention.ms": str(30 * _DAY_MS), "max.message.bytes": str(8 * 1024 * 1024)},
            "Records that could not be processed; headers say where from and why (DeadLetterHeaders).",
            ("every consumer",),
            ("consumers: dead_letters", "operators"),
        ),
    )
}


def topic(key: TopicKey | str) -> Topic:
    """The topic registered under ``key``; an unknown key is answered with the valid ones."""
    try:
        return TOPICS[TopicKey(key)]
    except ValueError:
        valid = ", ".join(k.value for k in TopicKey)
        raise KeyError(f"unknown topic {key!r}; valid: {valid}") from None


def topic_name(key: TopicKey | str, prefix: str = "") -> str:
    """The name of topic ``key`` in a deployment whose topics carry ``prefix``."""
    return f"{prefix}{topic(key).name}"


class GroupKey(StrEnum):
    """Stable handles for Fulmen's own consumer groups."""

    RUNNERS = "runners"
    CONSUMERS = "consumers"
    TRAINER = "trainer"


GROUPS: dict[GroupKey, str] = {
    GroupKey.RUNNERS: "fulmen.runners",  # the runners, over the tasks topic
    GroupKey.CONSUMERS: "fulmen.consumers",  # one group per sink of `fulmen consume`: fulmen.consumers.<sink>
    GroupKey.TRAINER: "fulmen.trainer",  # the trainer's collector, over the transitions topic
}


def _fulmen_group(group_id: str) -> bool:
    consumers = GROUPS[GroupKey.CONSUMERS]
    return group_id in GROUPS.values() or group_id.startswith(f"{consumers}.")


def group_name(group_id: str | GroupKey, prefix: str = "") -> str:
    """The consumer group id to join for ``group_id`` in a deployment whose topics carry ``prefix``.

    A :class:`GroupKey`, or one of Fulmen's default group names (``fulmen.runners``, ``fulmen.trainer``,
    ``fulmen.consumers.<sink>``), takes the prefix; any other id was chosen explicitly and is kept as given.
    Apply it once, to the configured name (never to a name it already returned).
    """
    name = GROUPS[group_id] if isinstance(group_id, GroupKey) else group_id
    return f"{prefix}{name}" if _fulmen_group(name) else name
