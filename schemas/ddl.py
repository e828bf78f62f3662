"""The ClickHouse schema, as an ordered list of versioned migrations.

A migration is a version number, a name and DDL statements written with ``{db}`` for the database. Every
statement is idempotent (``IF NOT EXISTS``), so a migration interrupted half-way is simply applied again.
Never edit a released migration: add a new one.

Engines and keys:

* Kafka delivers at least once, so every table that consumers fill is a ``ReplacingMergeTree`` whose sort key
  is the identity of a record; a redelivered record replaces itself. Queries the system runs read with
  ``FINAL`` (or the ``final=1`` setting), so duplicates are never visible, even before a background merge.
* ``otel_traces`` keeps the column names of the OpenTelemetry Collector's ClickHouse exporter, so its
  dashboards and queries work unchanged, plus typed columns that training reads. It is sorted by
  ``(RolloutId, TraceId, SpanId)``: the hot query gathers the spans of one rollout; time-range queries prune by
  the daily partition and a min-max index on ``Timestamp``.
* ``rollouts`` keeps the latest lifecycle state per rollout attempt (the version column is the status rank).
* ``feedback`` keeps every late reward (one row per feedback and resolved call or episode); readers pick the latest
  per call or episode and name (the rule is at its DDL).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MIGRATIONS", "MIGRATIONS_TABLE", "TABLES", "Migration"]

MIGRATIONS_TABLE = "schema_migrations"

# Logical table names used by the code. The DDL below is where each table and its columns are defined (types,
# codecs, keys); it is not the only place a column is named: the consumers name them when they build rows
# (consumers/otlp_rows.py, consumers/event_sinks.py, the transitions worker) and the queries that read them
# (consumers/transitions/reader.py, fulmen/cli) name them too, so renaming a column means changing those as well.
TABLES = {
    "spans": "otel_traces",
    "rollouts": "rollouts",
    "transitions": "transitions",
    "model_versions": "model_versions",
    "train_steps": "train_steps",
    "dead_letters": "dead_letters",
    "feedback": "feedback",
    "tasks": "tasks",
    "promotions": "promotions",
    "prompt_bundles": "prompt_bundles",
    "prompt_promotions": "prompt_promotions",
}


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    statements: tuple[str, ...]

    def render(self, database: str) -> list[str]:
        return [statement.format(db=database) for statement in self.statements]


_ATTRS = "Map(LowCardinality(String), String)"

_SPANS = f"""
CREATE TABLE IF NOT EXISTS {{db}}.otel_traces (
    Timestamp DateTime64(9, 'UTC') CODEC(Delta, ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ParentSpanId String CODEC(ZSTD(1)),
    TraceState String CODEC(ZSTD(1)),
    SpanName LowCardinality(String) CODEC(ZSTD(1)),
    SpanKind LowCardinality(String) CODEC(ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    ResourceAttributes {_ATTRS} CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion String CODEC(ZSTD(1)),
    SpanAttributes {_ATTRS} CODEC(ZSTD(1)),
    Duration UInt64 CODEC(ZSTD(1)),
    StatusCode LowCardinality(String) CODEC(ZSTD(1)),
    StatusMessage String CODEC(ZSTD(1)),
    `Events.Timestamp` Array(DateTime64(9, 'UTC')) CODEC(ZSTD(1)),
    `Events.Name` Array(LowCardinality(String)) CODEC(ZSTD(1)),
    `Events.Attributes` Array({_ATTRS}) CODEC(ZSTD(1)),
    `Links.TraceId` Array(String) CODEC(ZSTD(1)),
    `Links.SpanId` Array(String) CODEC(ZSTD(1)),
    `Links.TraceState` Array(String) CODEC(ZSTD(1)),
    `Links.Attributes` Array({_ATTRS}) CODEC(ZSTD(1)),
    RolloutId String CODEC(ZSTD(1)),
    Attempt UInt32 CODEC(ZSTD(1)),
    AgentName LowCardinality(String) CODEC(ZSTD(1)),
    ModelVersion Nullable(UInt64) CODEC(ZSTD(1)),
    PromptTokenIds Array(UInt32) CODEC(ZSTD(1)),
    ResponseTokenIds Array(UInt32) CODEC(ZSTD(1)),
    ResponseLogprobs Array(Float32) CODEC(ZSTD(1)),
    Reward Nullable(Float64) CODEC(ZSTD(1)),
    IngestedAt DateTime64(3, 'UTC') DEFAULT now64(3) CODEC(Delta, ZSTD(1)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_timestamp Timestamp TYPE minmax GRANULARITY 1,
    INDEX idx_res_attr_key mapKeys(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_key mapKeys(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_duration Duration TYPE minmax GRANULARITY 1
) ENGINE = ReplacingMergeTree
PARTITION BY toDate(Timestamp)
ORDER BY (RolloutId, TraceId, SpanId)
SETTINGS index_granularity = 8192
"""

_ROLLOUTS = """
CREATE TABLE IF NOT EXISTS {db}.rollouts (
    RolloutId String,
    Attempt UInt32,
    TaskId String,
    GroupId String,
    Mode LowCardinality(String),
    Status LowCardinality(String),
    StatusRank UInt8,
    Reward Nullable(Float64),
    Error String CODEC(ZSTD(1)),
    RunnerId LowCardinality(String),
    ModelVersion Nullable(UInt64),
    Timestamp DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    INDEX idx_group GroupId TYPE bloom_filter(0.01) GRANULARITY 1
) ENGINE = ReplacingMergeTree(StatusRank)
ORDER BY (RolloutId, Attempt)
"""

_TRANSITIONS = """
CREATE TABLE IF NOT EXISTS {db}.transitions (
    RolloutId String,
    Attempt UInt32,
    TaskId String,
    GroupId String,
    Mode LowCardinality(String),
    Status LowCardinality(String),
    CallIndex UInt32,
    TraceId String,
    SpanId String,
    AgentName LowCardinality(String),
    ModelVersion Nullable(UInt64),
    PromptTokenIds Array(UInt32) CODEC(ZSTD(1)),
    ResponseTokenIds Array(UInt32) CODEC(ZSTD(1)),
    ResponseLogprobs Array(Float32) CODEC(ZSTD(1)),
    Reward Nullable(Float64),
    IntermediateReward Nullable(Float64),
    EpisodeReward Nullable(Float64),
    CreatedAt DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1))
) ENGINE = ReplacingMergeTree(CreatedAt)
ORDER BY (GroupId, RolloutId, Attempt, SpanId)
"""

_MODEL_VERSIONS = """
CREATE TABLE IF NOT EXISTS {db}.model_versions (
    ModelName String,
    Version UInt64,
    Uri String,
    Format LowCardinality(String),
    BaseModel String,
    RunId String,
    Step UInt64,
    CreatedAt DateTime64(6, 'UTC')
) ENGINE = ReplacingMergeTree
ORDER BY (ModelName, Version)
"""

_TRAIN_STEPS = """
CREATE TABLE IF NOT EXISTS {db}.train_steps (
    RunId String,
    Step UInt64,
    ModelVersion UInt64,
    NumTransitions UInt64,
    NumGroups UInt64,
    RewardMean Float64,
    RewardStd Float64,
    AdvantageMean Float64,
    AdvantageStd Float64,
    Loss Float64,
    ClipFraction Float64,
    Kl Nullable(Float64),
    TokensPerS Float64,
    RolloutWaitS Float64,
    TrainS Float64,
    PublishS Float64,
    DroppedStale UInt64,
    Extra Map(LowCardinality(String), Float64),
    CreatedAt DateTime64(6, 'UTC')
) ENGINE = ReplacingMergeTree
ORDER BY (RunId, Step)
"""

# The dead-letter topic's records, for people (the dashboard): where each came from, why, and a preview of its
# bytes (the topic keeps the whole record for replay). Keyed by its place in the dead-letter topic.
_DEAD_LETTERS = """
CREATE TABLE IF NOT EXISTS {db}.dead_letters (
    Topic String,
    Partition UInt32,
    Offset UInt64,
    SourceTopic String,
    SourcePartition Int32,
    SourceOffset Int64,
    ErrorType LowCardinality(String),
    Error String CODEC(ZSTD(1)),
    ConsumerGroup LowCardinality(String),
    FailedAt DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1)),
    Key String CODEC(ZSTD(1)),
    ValuePreview String CODEC(ZSTD(1)),
    ValueBytes UInt64,
    Timestamp DateTime64(3, 'UTC') CODEC(Delta, ZSTD(1))
) ENGINE = ReplacingMergeTree
ORDER BY (Topic, Partition, Offset)
"""

# The Collector exporter's two derived columns (its newer table versions have them; Grafana's trace views and its
# full-text search use them): each attribute as "key=value". ALIAS columns: computed on read, nothing stored.
_ATTRIBUTE_ITEMS = tuple(
    f"ALTER TABLE {{db}}.otel_traces ADD COLUMN IF NOT EXISTS {items} Array(String) "
    f"ALIAS arrayMap((key, value) -> concat(key, '=', value), mapKeys({column}), mapValues({column}))"
    for items, column in (("ResourceAttributeItems", "ResourceAttributes"), ("SpanAttributeItems", "SpanAttributes"))
)

# One LoRA adapter per trained agent (``FULMEN_TRAIN_ADAPTERS=per_agent``): each adapter has its own versions, so the
# adapter joins the sorting key (a column added in the same ALTER may, if it has no default expression: '' anyway).
_MODEL_VERSION_ADAPTER = (
    "ALTER TABLE {db}.model_versions ADD COLUMN IF NOT EXISTS Adapter String, "
    "MODIFY ORDER BY (ModelName, Version, Adapter)",
)

# Late feedback (``Feedback`` events), resolved by the feedback consumer to what it scores: RolloutId, Attempt, TraceId
# and SpanId name the call or the episode, as the store knew it when the feedback was resolved:
#   response: the call's span (its RolloutId, Attempt, TraceId, SpanId; one row per choice when n > 1);
#   rollout:  RolloutId = the target, Attempt = its latest attempt, TraceId = SpanId = '';
#   trace:    TraceId = the target, RolloutId and Attempt = those of its spans ('' and 0 when none), SpanId = ''.
# Rule for readers: every feedback is kept; per (RolloutId, SpanId, Name) the row with the latest Timestamp wins.
# SpanId = '' scores the whole episode (it replaces the episode reward); a SpanId scores that one call. The replay's
# query: SELECT RolloutId, SpanId, argMax(Value, Timestamp) FROM feedback FINAL WHERE Name = 'reward'
#        GROUP BY RolloutId, SpanId
# Feedback whose target never appears is not here: it is on the dead-letter topic (and in dead_letters) with why.
_FEEDBACK = """
CREATE TABLE IF NOT EXISTS {db}.feedback (
    FeedbackId String,
    Target LowCardinality(String),
    TargetId String,
    RolloutId String,
    Attempt UInt32,
    TraceId String,
    SpanId String,
    Name LowCardinality(String),
    Value Float64,
    Comment String CODEC(ZSTD(1)),
    Source LowCardinality(String),
    Timestamp DateTime64(6, 'UTC')
) ENGINE = ReplacingMergeTree
ORDER BY (RolloutId, SpanId, Name, FeedbackId)
"""

# The tasks as they were dispatched (``RolloutRequest`` on the tasks topic): the task payload ``Input`` (JSON, handed to
# the agent unchanged) of every rollout attempt, so a later run can take its tasks from a selection over what was
# stored (``fulmen train --tasks-sql``). One row per request; a retried attempt replaces nothing (same payload).
_TASKS = """
CREATE TABLE IF NOT EXISTS {db}.tasks (
    RolloutId String,
    Attempt UInt32,
    TaskId String,
    GroupId String,
    Mode LowCardinality(String),
    Input String CODEC(ZSTD(1)),
    Metadata Map(LowCardinality(String), String),
    ModelVersion Nullable(UInt64),
    CreatedAt DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1))
) ENGINE = ReplacingMergeTree
ORDER BY (TaskId, RolloutId, Attempt)
"""

# Which version serves, and the candidates a gated run rejected (``ModelPromotion`` on the promotions topic): one row
# per decision, in the order they were made; what serves now is the latest promote or rollback of a model.
_PROMOTIONS = """
CREATE TABLE IF NOT EXISTS {db}.promotions (
    ModelName String,
    Adapter String,
    Version UInt64,
    RunId String,
    Action LowCardinality(String),
    Score Nullable(Float64),
    ServingVersion Nullable(UInt64),
    ServingScore Nullable(Float64),
    Reason String CODEC(ZSTD(1)),
    Uri String,
    BaseModel String,
    CreatedAt DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1))
) ENGINE = ReplacingMergeTree
ORDER BY (ModelName, Adapter, CreatedAt, RunId, Version, Action)
"""

# A gated decision's paired test (issue 44): the held-out tasks validated on both versions, the mean per-task gain,
# its interval at Confidence, the Margin the interval had to clear (NULL for decisions made by hand), and the
# candidate's Outcomes per held-out task id (1 solved, 0 not).
_PROMOTION_TEST = (
    "ALTER TABLE {db}.promotions ADD COLUMN IF NOT EXISTS HeldoutN Nullable(UInt32), "
    "ADD COLUMN IF NOT EXISTS Gain Nullable(Float64), ADD COLUMN IF NOT EXISTS GainLow Nullable(Float64), "
    "ADD COLUMN IF NOT EXISTS GainHigh Nullable(Float64), ADD COLUMN IF NOT EXISTS Confidence Nullable(Float64), "
    "ADD COLUMN IF NOT EXISTS Margin Nullable(Float64), ADD COLUMN IF NOT EXISTS Outcomes Map(String, Float64)",
)

# Prompt bundles (``PromptBundle`` on the prompts topic, issue 29): immutable, keyed by their content hash, with
# their lineage (Parents) and the per-validation-task scores that chose them. Templates keeps each template slot's
# original template (the text the agent formats).
_PROMPT_BUNDLES = """
CREATE TABLE IF NOT EXISTS {db}.prompt_bundles (
    BundleId String,
    Slots Map(String, String) CODEC(ZSTD(1)),
    Templates Map(String, String) CODEC(ZSTD(1)),
    Parents Array(String),
    Scores Map(String, Float64),
    Agent Nullable(String),
    Source LowCardinality(String),
    RunId String,
    CreatedAt DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1))
) ENGINE = ReplacingMergeTree
ORDER BY BundleId
"""

# Which bundle serves the calls that name none (``PromptPromotion``), one row per decision; what serves now in a
# scope is its latest row (Agent '' is every agent; BundleId '' the agent's own prompts).
_PROMPT_PROMOTIONS = """
CREATE TABLE IF NOT EXISTS {db}.prompt_promotions (
    Agent String,
    Action LowCardinality(String),
    BundleId String,
    Previous String,
    Reason String CODEC(ZSTD(1)),
    CreatedAt DateTime64(6, 'UTC') CODEC(Delta, ZSTD(1))
) ENGINE = ReplacingMergeTree
ORDER BY (Agent, CreatedAt, BundleId, Action)
"""

# A rollout records both its model version and its prompt bundle ('' when it named none), and so does each of its
# transitions (the bundle the gateway applied to that call: the promoted one for a rollout that named none).
_PROMPT_BUNDLE_COLUMNS = (
    "ALTER TABLE {db}.rollouts ADD COLUMN IF NOT EXISTS PromptBundle String DEFAULT ''",
    "ALTER TABLE {db}.transitions ADD COLUMN IF NOT EXISTS PromptBundle String DEFAULT ''",
)

# The groups each step trained on, in the order it took them: a replay of the run can take the same batches in the
# same order (examples/train.py ``--replay-store``).
_TRAIN_STEP_GROUPS = ("ALTER TABLE {db}.train_steps ADD COLUMN IF NOT EXISTS GroupIds Array(String)",)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "spans (otel_traces)", (_SPANS,)),
    Migration(2, "rollouts", (_ROLLOUTS,)),
    Migration(3, "transitions", (_TRANSITIONS,)),
    Migration(4, "model_versions", (_MODEL_VERSIONS,)),
    Migration(5, "train_steps", (_TRAIN_STEPS,)),
    Migration(6, "otel_traces: the Collector exporter's attribute item columns", _ATTRIBUTE_ITEMS),
    Migration(7, "dead_letters", (_DEAD_LETTERS,)),
    Migration(8, "model_versions: the agent's adapter", _MODEL_VERSION_ADAPTER),
    Migration(9, "feedback", (_FEEDBACK,)),
    Migration(10, "tasks: the dispatched task payloads", (_TASKS,)),
    Migration(11, "promotions: which model version serves", (_PROMOTIONS,)),
    Migration(
        12,
        "prompt bundles and their promotions; the bundle of each rollout and transition",
        (_PROMPT_BUNDLES, _PROMPT_PROMOTIONS, *_PROMPT_BUNDLE_COLUMNS),
    ),
    Migration(13, "promotions: the gate's paired test", _PROMOTION_TEST),
    Migration(14, "train_steps: the groups each step trained on", _TRAIN_STEP_GROUPS),
)
