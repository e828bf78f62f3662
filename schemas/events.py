"""The event contracts carried on Fulmen's Kafka topics, as pydantic v2 models.

Every event has a ``schema_version``; a reader refuses versions it does not know instead of guessing. Unknown
fields are refused too (``extra="forbid"``): a typo in a submitted task fails loudly, and a change of contract
bumps ``schema_version``. Times are timezone-aware UTC. Identifiers are restricted to characters that are safe
in a URL path segment, because the LLM gateway receives rollout ids in its path
(``/rollout/{rollout_id}/attempt/{attempt}/v1``).
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, model_validator

__all__ = [
    "IDENTIFIER_PATTERN",
    "PRODUCTION_ROLLOUT_PREFIX",
    "TERMINAL_STATUSES",
    "DeadLetterHeaders",
    "Event",
    "Feedback",
    "FeedbackTarget",
    "Identifier",
    "ModelPromotion",
    "ModelVersion",
    "PromotionAction",
    "RolloutEvent",
    "RolloutMode",
    "RolloutRequest",
    "RolloutStatus",
    "TrainStep",
    "Transition",
    "TransitionBatch",
    "new_id",
    "production_rollout_id",
    "production_trace_id",
    "utc_now",
]

IDENTIFIER_PATTERN = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
Identifier = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:\-]+$")]
"""An id that is safe in a URL path segment, a Kafka key and a ClickHouse key."""
GroupIdentifier = Annotated[str, StringConstraints(max_length=128, pattern=r"^[A-Za-z0-9._:\-]*$")]
"""An :data:`Identifier`, or '' for a rollout that belongs to no group (a ``production`` one)."""

BundleIdentifier = Annotated[str, StringConstraints(pattern=r"^pb-[0-9a-f]{12}$")]
"""A prompt bundle's id (:class:`fulmen.schemas.prompts.PromptBundle`): ``pb-`` and 12 hex digits."""

PRODUCTION_ROLLOUT_PREFIX = "trace-"
"""A production episode's rollout id is this prefix and its trace id (``trace-<32 hex digits>``), attempt 1."""
_PRODUCTION_ROLLOUT = re.compile(r"^trace-([0-9a-f]{32})$")


def utc_now() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    """A fresh random id (32 hex characters)."""
    return uuid.uuid4().hex


def production_rollout_id(trace_id: str) -> str:
    """The rollout id of the production episode of trace ``trace_id`` (32 lowercase hex digits)."""
    return f"{PRODUCTION_ROLLOUT_PREFIX}{trace_id}"


def production_trace_id(rollout_id: str) -> str | None:
    """The trace whose production episode ``rollout_id`` names, or None when it names none."""
    match = _PRODUCTION_ROLLOUT.match(rollout_id)
    return match.group(1) if match else None


def _require_utc(value: datetime) -> datetime:
    """Naive datetimes are taken as UTC; aware ones are converted to UTC."""
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


UtcDatetime = Annotated[datetime, AfterValidator(_require_utc)]


class Event(BaseModel):
    """Base of every event: strict about unknown fields, immutable, versioned."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class RolloutMode(StrEnum):
    """Why a rollout ran. ``train`` and ``val`` rollouts are dispatched (``fulmen train``, ``fulmen submit``) and
    run by a runner. A ``production`` rollout is an episode of an agent that Fulmen does not run (it calls the LLM
    gateway's plain ``/v1`` endpoint): ``fulmen consume`` groups its calls by trace and ends the episode when the
    trace goes idle; it has no group and is never dispatched (docs/continuous.md, "Agents in production")."""

    TRAIN = "train"
    VAL = "val"
    PRODUCTION = "production"

    @property
    def dispatched(self) -> bool:
        """Whether rollouts of this mode are requested and run by a runner (not ``production``)."""
        return self is not RolloutMode.PRODUCTION


class RolloutStatus(StrEnum):
    """Lifecycle of one attempt of a rollout, in order. The last three are terminal."""

    QUEUED = "queued"
    CLAIMED = "claimed"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"

    @property
    def rank(self) -> int:
        """Position in the lifecycle; the store keeps the highest rank per rollout attempt."""
        return _STATUS_RANK[self]

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATUSES


_STATUS_RANK = {
    RolloutStatus.QUEUED: 0,
    RolloutStatus.CLAIMED: 1,
    RolloutStatus.RUNNING: 2,
    RolloutStatus.SUCCEEDED: 3,
    RolloutStatus.FAILED: 3,
    RolloutStatus.TIMED_OUT: 3,
}
TERMINAL_STATUSES = frozenset({RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.TIMED_OUT})


class RolloutRequest(Event):
    """One task to run once through the user's agent; published to the tasks topic, keyed by rollout id.

    ``group_id`` ties together the G rollouts of one task that GRPO compares with each other. ``input`` is the
    task itself, handed to the agent unchanged. ``attempt`` starts at 1; a retry is a new request with the
    same rollout id and ``attempt + 1``, up to ``max_attempts``.
    """

    schema_version: Literal[1] = 1
    rollout_id: Identifier = Field(default_factory=new_id)
    task_id: Identifier
    group_id: Identifier
    attempt: int = Field(default=1, ge=1)
    max_attempts: int = Field(default=3, ge=1, le=100)
    timeout_s: float = Field(default=600.0, gt=0, le=7 * 24 * 3600)
    mode: RolloutMode = RolloutMode.TRAIN
    input: dict[str, Any]
    model_version: int | None = Field(default=None, ge=0, description="version the request was dispatched under")
    metadata: dict[str, str] = Field(default_factory=dict)
    created_at: UtcDatetime = Field(default_factory=utc_now)
    prompt_bundle: BundleIdentifier | None = Field(
        default=None, description="the prompt bundle the gateway applies to its calls (None: the promoted one)"
    )
    seed: int | None = Field(
        default=None,
        ge=0,
        lt=2**63,
        description="the rollout's sampling seed: the gateway derives each sampled "
        "call's seed from it, the attempt and the call's number (None: unseeded, the engine draws)",
    )

    @model_validator(mode="after")
    def _attempt_within_budget(self) -> RolloutRequest:
        if self.attempt > self.max_attempts:
            raise ValueError(f"attempt {self.attempt} exceeds max_attempts {self.max_attempts}")
        return self

    @model_validator(mode="after")
    def _dispatchable(self) -> RolloutRequest:
        if not self.mode.dispatched:
            raise ValueError(
                f"mode: {self.mode.value} rollouts are recorded from agents Fulmen does not run, never "
                "dispatched; use train or val"
            )
        if production_trace_id(self.rollout_id) is not None:
            raise ValueError(
                f"rollout_id: {self.rollout_id} is a production episode's id "
                f"({PRODUCTION_ROLLOUT_PREFIX}<trace id>); choose another"
            )
        return self


class RolloutEvent(Event):
    """A lifecycle change of one attempt of a rollout; published to the rollouts topic, keyed by rollout id.

    ``reward`` is the episode reward and only a succeeded rollout has one (it may still be None when the agent
    returned none). A failed or timed-out rollout carries ``error``. Only a ``production`` rollout may have no
    group (``group_id`` '').
    """

    schema_version: Literal[1] = 1
    rollout_id: Identifier
    attempt: int = Field(ge=1)
    status: RolloutStatus
    task_id: Identifier
    group_id: GroupIdentifier
    mode: RolloutMode = RolloutMode.TRAIN
    reward: float | None = None
    error: str | None = None
    runner_id: str = ""
    model_version: int | None = Field(default=None, ge=0)
    timestamp: UtcDatetime = Field(default_factory=utc_now)
    prompt_bundle: BundleIdentifier | None = None

    @model_validator(mode="after")
    def _fields_fit_status(self) -> RolloutEvent:
        if self.reward is not None and self.status is not RolloutStatus.SUCCEEDED:
            raise ValueError(f"reward: only a succeeded rollout has a reward, this one is {self.status.value}")
        if self.status in (RolloutStatus.FAILED, RolloutStatus.TIMED_OUT) and not self.error:
            raise ValueError(f"error: a {self.status.value} rollout must say why")
        _check_group(self.group_id, self.mode)
        return self


def _check_group(group_id: str, mode: RolloutMode) -> None:
    if not group_id and mode is not RolloutMode.PRODUCTION:
        raise ValueError(f"group_id: a {mode.value} rollout belongs to a group; only a production rollout has none")


class Transition(Event):
    """One LLM call of an episode: the state (prompt tokens), the action (response tokens) and its reward.

    Token ids are exactly those the model consumed and produced (never re-tokenized). ``intermediate_reward`` is
    the reward observed right after this call, if any. ``reward`` is the credit assigned to this call, which
    the run that trains computes (``FULMEN_TRAIN_CREDIT``) from its batch's ``episode_reward`` and the calls'
    intermediate rewards: None on the transitions topic and in the store, which carry only what was observed.
    """

    schema_version: Literal[1] = 1
    rollout_id: Identifier
    attempt: int = Field(ge=1)
    index: int = Field(ge=0, description="position of the call within the episode")
    trace_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    span_id: str = Field(pattern=r"^[0-9a-f]{16}$")
    agent_name: str = ""
    model_version: int | None = Field(default=None, ge=0)
    prompt_token_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    response_token_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    response_logprobs: list[float] | None = None
    reward: float | None = None
    intermediate_reward: float | None = None
    prompt_bundle: str = Field(default="", description="the prompt bundle the gateway applied to the call ('': none)")

    @model_validator(mode="after")
    def _logprobs_match_response(self) -> Transition:
        if self.response_logprobs is not None and len(self.response_logprobs) != len(self.response_token_ids):
            raise ValueError(
                f"response_logprobs: {len(self.response_logprobs)} logprobs for "
                f"{len(self.response_token_ids)} response tokens"
            )
        return self


class TransitionBatch(Event):
    """All transitions of one finished rollout attempt; published to the transitions topic, keyed by group id ('' for
    a ``production`` rollout, which has no group)."""

    schema_version: Literal[1] = 1
    rollout_id: Identifier
    attempt: int = Field(ge=1)
    task_id: Identifier
    group_id: GroupIdentifier
    mode: RolloutMode = RolloutMode.TRAIN
    status: RolloutStatus
    episode_reward: float | None = None
    model_version: int | None = Field(default=None, ge=0)
    transitions: list[Transition] = Field(default_factory=list)
    created_at: UtcDatetime = Field(default_factory=utc_now)

    @model_validator(mode="after")
    def _transitions_belong_here(self) -> TransitionBatch:
        if not self.status.terminal:
            raise ValueError(f"status: a transition batch is built from a finished rollout, not {self.status.value}")
        _check_group(self.group_id, self.mode)
        for position, transition in enumerate(self.transitions):
            if (transition.rollout_id, transition.attempt) != (self.rollout_id, self.attempt):
                raise ValueError(
                    f"transitions.{position}: belongs to rollout {transition.rollout_id} attempt "
                    f"{transition.attempt}, not {self.rollout_id} attempt {self.attempt}"
                )
            if transition.index != position:
                raise ValueError(f"transitions.{position}.index: is {transition.index}, expected {position}")
        return self


class ModelVersion(Event):
    """A trained model ready to serve; published to the compacted models topic, keyed by :attr:`topic_key`.

    ``adapter`` names one agent's LoRA adapter (``FULMEN_TRAIN_ADAPTERS=per_agent``: one adapter per trained agent
    on a frozen ``base_model``; then ``format`` is ``hf_lora_adapter`` and ``version`` is that adapter's); empty for
    the model itself (full weights, or the one adapter every agent shares). The gateway serves an adapter to the
    calls that name its agent, and the model to every other call.
    """

    schema_version: Literal[1] = 1
    model_name: Identifier
    version: int = Field(ge=0)
    uri: str = Field(min_length=1, description="where the checkpoint is: a local path or an object-store URI")
    format: Literal["hf", "hf_lora_adapter"] = "hf"
    base_model: str = ""
    run_id: str = ""
    step: int = Field(default=0, ge=0)
    adapter: Annotated[str, StringConstraints(max_length=128, pattern=r"^[A-Za-z0-9._:\-]*$")] = Field(
        default="", description="the agent whose LoRA adapter this is; empty: the model every other call uses"
    )
    created_at: UtcDatetime = Field(default_factory=utc_now)

    @model_validator(mode="after")
    def _adapter_is_lora(self) -> ModelVersion:
        if self.adapter and self.format != "hf_lora_adapter":
            raise ValueError(f"format: an agent's adapter ({self.adapter}) is an hf_lora_adapter, not {self.format}")
        return self

    @property
    def topic_key(self) -> str:
        """The record key on the compacted models topic: the model name, with ``/<adapter>`` for an agent's
        adapter (so compaction keeps the latest version of the model and of each adapter)."""
        return f"{self.model_name}/{self.adapter}" if self.adapter else self.model_name


class PromotionAction(StrEnum):
    """What a :class:`ModelPromotion` decides."""

    PROMOTE = "promote"  # this version serves the calls that name none (a gated run's candidate passed, or by hand)
    ROLLBACK = "rollback"  # back to an earlier version (by hand): it serves from now on
    REJECT = "reject"  # a gated run's candidate scored below the serving version: it does not serve


class ModelPromotion(Event):
    """A decision about which version of a model serves; published to the compacted promotions topic.

    ``promote`` and ``rollback`` name the version that serves from now on (keyed by model name and adapter, so
    compaction keeps the one in force); ``reject`` records a candidate that did not pass (keyed by the candidate
    itself, so it never replaces what serves). ``model`` is the version's own event (its checkpoint, format, base
    model, run), so a gateway that follows promotions loads it without looking anything up. ``score`` is the
    candidate's held-out score, ``serving_score`` that of the version it was compared with (None when decided by
    hand). A gated decision also carries its paired test (:mod:`fulmen.infra.stats`): ``heldout_n`` tasks validated
    on both, the mean per-task ``gain``, its interval ``gain_low``-``gain_high`` at ``confidence``, the ``margin``
    the interval had to clear; and the candidate's ``outcomes`` per held-out task.
    """

    schema_version: Literal[1] = 1
    action: PromotionAction
    model: ModelVersion
    score: float | None = None
    serving_version: int | None = Field(default=None, ge=0)
    serving_score: float | None = None
    reason: str = Field(default="", max_length=1024)
    created_at: UtcDatetime = Field(default_factory=utc_now)
    heldout_n: int | None = Field(default=None, ge=0)
    gain: float | None = Field(default=None, ge=-1, le=1)
    gain_low: float | None = Field(default=None, ge=-1, le=1)
    gain_high: float | None = Field(default=None, ge=-1, le=1)
    confidence: float | None = Field(default=None, gt=0, lt=1)
    margin: float | None = Field(default=None, ge=0, lt=1)
    outcomes: dict[str, float] = Field(
        default_factory=dict,
        max_length=20_000,
        description="the candidate's held-out outcome per task id (1 solved, 0 not, a share when run several "
        "times): the bar a later run compares its candidates with, task by task",
    )

    @property
    def topic_key(self) -> str:
        """The model's key (what serves) for promote and rollback; the candidate's own for a rejection."""
        if self.action is PromotionAction.REJECT:
            return f"{self.model.topic_key}@{self.model.run_id}/v{self.model.version}"
        return self.model.topic_key


class TrainStep(Event):
    """Metrics of one optimisation step; published to the metrics topic, keyed by run id."""

    schema_version: Literal[1] = 1
    run_id: Identifier
    step: int = Field(ge=0)
    model_version: int = Field(ge=0, description="the version this step produced")
    num_transitions: int = Field(ge=0)
    num_groups: int = Field(ge=0)
    reward_mean: float
    reward_std: float = Field(ge=0)
    advantage_mean: float = 0.0
    advantage_std: float = Field(default=0.0, ge=0)
    loss: float
    clip_fraction: float = Field(default=0.0, ge=0, le=1)
    kl: float | None = None
    tokens_per_s: float = Field(default=0.0, ge=0)
    rollout_wait_s: float = Field(default=0.0, ge=0)
    train_s: float = Field(default=0.0, ge=0)
    publish_s: float = Field(default=0.0, ge=0)
    dropped_stale: int = Field(default=0, ge=0)
    extra: dict[str, float] = Field(default_factory=dict)
    group_ids: list[Identifier] = Field(
        default_factory=list, description="the groups this step trained on, in the order it took them"
    )
    created_at: UtcDatetime = Field(default_factory=utc_now)


class FeedbackTarget(StrEnum):
    """What a :class:`Feedback` scores, named by the id its ``target_id`` holds."""

    RESPONSE = "response"  # one LLM call: the OpenAI response id the gateway answered with (gen_ai.response.id)
    ROLLOUT = "rollout"  # a whole episode: a rollout id (its latest attempt)
    TRACE = "trace"  # a whole episode: a trace id (32 lowercase hex digits), for agents that Fulmen does not run


_TRACE_ID = re.compile(r"^(?!0{32})[0-9a-f]{32}$")  # W3C: lowercase hex, never all zero
_RESPONSE_ID = re.compile(r"^[^\s\x00-\x1f\x7f-\x9f]+$")  # no spaces, no control characters


class Feedback(Event):
    """A reward that arrives after the fact, for an LLM call, a rollout or a trace; published to the feedback topic,
    keyed by ``target_id``.

    It may come any time after the call (a user's thumbs-up a day later), from the LLM gateway's
    ``POST /v1/feedback`` or ``fulmen feedback``. The feedback consumer resolves the target in the store (the call's
    span, the rollout's latest attempt, the trace's rollout) and stores one row per resolved call or episode; a
    target that is still unknown once ``FULMEN_FEEDBACK_RESOLVE_GRACE_S`` has passed is dead-lettered, never dropped.
    Several feedbacks with the same ``name`` for the same call or episode are all kept; the latest ``timestamp``
    wins when they are read.
    """

    schema_version: Literal[1] = 1
    feedback_id: Identifier = Field(default_factory=new_id, description="its own id (a redelivery keeps it)")
    target: FeedbackTarget = Field(description="what target_id names: an LLM call's response, a rollout or a trace")
    target_id: str = Field(
        min_length=1, max_length=256, description="the response id, rollout id or trace id (32 lowercase hex)"
    )
    name: Identifier = Field(default="reward", description="what is scored; 'reward' is what training reads")
    value: float = Field(allow_inf_nan=False, description="the score (finite)")
    comment: str = Field(default="", max_length=4096, description="free text kept with the score, for people")
    source: str = Field(default="", max_length=128, description="who sent it: 'api' (the gateway), 'cli', ...")
    timestamp: UtcDatetime = Field(default_factory=utc_now, description="when it was sent; the latest one wins")

    @model_validator(mode="after")
    def _target_id_fits_target(self) -> Feedback:
        shown = self.target_id[:64]
        if self.target is FeedbackTarget.TRACE and not _TRACE_ID.fullmatch(self.target_id):
            raise ValueError(f"target_id: a trace id is 32 lowercase hex digits, not all zero; got {shown!r}")
        if self.target is FeedbackTarget.ROLLOUT and not IDENTIFIER_PATTERN.fullmatch(self.target_id):
            raise ValueError(f"target_id: a rollout id is 1 to 128 of A-Z a-z 0-9 . _ : -; got {shown!r}")
        if self.target is FeedbackTarget.RESPONSE and not _RESPONSE_ID.fullmatch(self.target_id):
            raise ValueError(f"target_id: a response id has no spaces or control characters; got {shown!r}")
        return self


class DeadLetterHeaders(BaseModel):
    """The Kafka headers of a dead-lettered record: where it came from and why it was rejected.

    The record itself keeps its original key and value bytes, so it can be replayed once the cause is fixed.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    source_topic: str
    source_partition: int = Field(ge=0)
    source_offset: int = Field(ge=0)
    error_type: str
    error: str
    consumer_group: str = ""
    failed_at: UtcDatetime = Field(default_factory=utc_now)

    PREFIX: ClassVar[str] = "fulmen.dlq."

    def to_kafka(self) -> list[tuple[str, bytes]]:
        """As aiokafka record headers: ``fulmen.dlq.<field>`` = UTF-8 text."""
        return [
            (f"{self.PREFIX}{name}", (value.isoformat() if isinstance(value, datetime) else str(value)).encode())
            for name, value in self.model_dump().items()
        ]

    @classmethod
    def from_kafka(cls, headers: list[tuple[str, bytes]] | tuple[tuple[str, bytes], ...]) -> DeadLetterHeaders:
        """Read the headers back; headers that are not ours are ignored."""
        prefix = cls.PREFIX
        values = {k[len(prefix) :]: v.decode() for k, v in headers if k.startswith(prefix)}
        return cls.model_validate(values)
