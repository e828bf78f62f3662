"""Settings of the training process (``fulmen train``): the shared sections plus ``FULMEN_TRAIN_*``.

A variable is ``FULMEN_TRAIN_<FIELD>``: ``FULMEN_TRAIN_GROUP_SIZE=8``, ``FULMEN_TRAIN_GROUPS_PER_STEP=4``,
``FULMEN_TRAIN_LR=1e-5``, ``FULMEN_TRAIN_MAX_STALENESS=1``, ``FULMEN_TRAIN_GROUP_TIMEOUT_S=300``,
``FULMEN_TRAIN_INCOMPLETE_POLICY=train_partial``, ``FULMEN_TRAIN_ESTIMATOR=grpo``, ``FULMEN_TRAIN_MODEL_PATH=...``,
``FULMEN_TRAIN_RUN_DIR=...``, ``FULMEN_TRAIN_STEPS=100``.

The algorithm (``FULMEN_TRAIN_ALGORITHM``: grpo, dr_grpo, rloo, dapo, gspo, cispo; ``fulmen.algorithm.rl.recipes``)
fills the defaults of the pieces it prescribes (estimator, policy_loss, loss_aggregation, clip_eps,
clip_eps_high, dynamic_sampling, overlong_shaping) that are not set explicitly; ``fulmen config show`` prints the
result. Names that live in the torch registries (estimators, losses, corrections) are checked when the trainer
starts (``fulmen.algorithm.service.run.check_training_settings``), so that this module imports no torch.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from fulmen.algorithm.rl.credit import CreditStrategy, credit_strategy
from fulmen.algorithm.rl.recipes import ALGORITHMS, Algorithm
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import IDENTIFIER_PATTERN, new_id

__all__ = [
    "ASYNC_CORRECTION",
    "NO_CORRECTION",
    "AdapterMode",
    "AdvantageScope",
    "IncompletePolicy",
    "TrainMode",
    "TrainSection",
    "TrainSettings",
]


ASYNC_CORRECTION = "tis"
"""The off-policy correction asynchronous mode and replay use unless ``correction`` is set: truncated importance
weights between the policy that sampled (recorded) and the weights at the start of the step (recomputed)."""

NO_CORRECTION = "none"
"""``correction`` set to none on purpose: uncorrected even where replay or asynchronous mode would pick
:data:`ASYNC_CORRECTION` (a replay of a run's own batches at the ages it trained them, with the objective it used)."""


class IncompletePolicy(StrEnum):
    """What to do with a group still missing rollouts when its timeout passes (see
    ``fulmen.algorithm.service.groups``)."""

    TRAIN_PARTIAL = "train_partial"  # train on the rollouts that arrived (at least min_group_size of them)
    DROP = "drop"  # drop the whole group


class TrainMode(StrEnum):
    """How generation and training overlap (see ``fulmen.algorithm.service.loop``)."""

    SYNC = "sync"  # dispatching and collecting pause while a step trains, saves, publishes and validates
    ASYNC = "async"  # they never pause: samples up to max_staleness versions old, importance-corrected


class AdapterMode(StrEnum):
    """What the trainer updates when it trains with LoRA (see ``fulmen.algorithm.trainer.adapters``)."""

    SHARED = "shared"  # one policy for every trained agent (one adapter with lora_r, or every weight)
    PER_AGENT = "per_agent"  # one LoRA adapter per agent of adapter_agents on one frozen base


class AdvantageScope(StrEnum):
    """Which rewards the advantage estimator compares within a group (see ``fulmen.algorithm.service.samples``)."""

    EPISODE = "episode"  # the rollouts' returns, broadcast to each rollout's transitions
    TRANSITION = "transition"  # every transition's credited reward against all transitions of the group


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


class TrainSection(BaseModel):
    """``FULMEN_TRAIN_*``: the dataset, the policy update, the group and staleness policies, the outputs."""

    run_id: str = Field(
        default_factory=lambda: f"run-{new_id()[:12]}",
        pattern=IDENTIFIER_PATTERN.pattern,
        description="this run's id, on its versions and rollouts; the same id resumes a run (default: a new one)",
    )
    run_dir: Path | None = Field(
        default=None, description="checkpoints go to <run_dir>/checkpoints/v<N>; default $FULMEN_HOME/runs/<run_id>"
    )
    keep_checkpoints: int = Field(
        default=0,
        ge=0,
        description="keep only the newest N versions' checkpoints in <run_dir>/checkpoints (and the version a "
        "promotion gate serves); 0 = every one. Full weights are the whole model per version (SmolLM2-135M: ~540 "
        "MB); N >= 2, as a lagging gateway may still load the one before the latest",
    )
    checkpoint_uri: str = Field(
        default="",
        description="also upload each version to this object store (s3://bucket/prefix; credentials and endpoint "
        "from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL) and publish it there: "
        "gateways on machines that do not share the run directory fetch it, and a run started again with no "
        "checkpoint of its own resumes from the latest there",
    )
    model_path: str = Field(default="", description="Hugging Face model directory, or 'tiny' (built offline)")
    model_name: str = Field(default="fulmen", pattern=IDENTIFIER_PATTERN.pattern, description="served name")
    agent: str = Field(
        default="",
        pattern=r"^$|^[\w.]+:[\w.]+$",
        description="module:function the runners run (recorded in request metadata)",
    )
    prompt_bundle: str = Field(
        default="",
        pattern=r"^$|^pb-[0-9a-f]{12}$",
        description="every training and "
        "validation rollout names this prompt bundle (the LLM gateway applies it; it must be "
        "on the prompts topic): GRPO on a chosen bundle's rollouts. '' = none named (the "
        "promoted bundle, else the agent's own prompts)",
    )
    steps: int = Field(
        default=10,
        ge=0,
        description="the run's last step (= model version); a resumed run "
        "continues up to it; 0 = validate the model once and stop (an evaluation)",
    )
    group_size: int = Field(default=8, ge=1, le=1024, description="rollouts per task (GRPO's G)")
    groups_per_step: int = Field(default=4, ge=1, description="complete groups in one optimisation step")
    max_groups_in_flight: int = Field(
        default=0, ge=0, description="dispatched, unfinished groups; 0 = 2 * groups_per_step"
    )
    min_group_size: int = Field(default=2, ge=1, description="fewest rollouts a timed-out group trains on")
    group_timeout_s: float = Field(
        default=0.0,
        ge=0,
        description="from dispatch to giving up on the rest; 0 = every attempt's timeout plus a minute",
    )
    incomplete_policy: IncompletePolicy = Field(
        default=IncompletePolicy.TRAIN_PARTIAL,
        description="a group still missing rollouts at its timeout: train_partial (on what arrived, if at least "
        "min_group_size) or drop",
    )
    max_staleness: int = Field(default=1, ge=0, description="train on transitions of versions >= current - this")
    mode: TrainMode = Field(
        default=TrainMode.SYNC,
        description="sync: dispatching pauses while a step trains; "
        "async: dispatching, generation and training overlap fully (in flight: "
        "(max_staleness + 1) * groups_per_step groups; correction tis unless set)",
    )
    algorithm: str = Field(
        default=Algorithm.GRPO,
        description="grpo, dr_grpo, rloo, dapo, gspo, cispo: sets the "
        "defaults of estimator, policy_loss, loss_aggregation, clip_eps, clip_eps_high, "
        "dynamic_sampling and overlong_shaping (each may still be set)",
    )
    estimator: str = Field(default="grpo", description="advantage estimator: grpo, dr_grpo, rloo")
    advantage_scope: AdvantageScope = Field(
        default=AdvantageScope.EPISODE,
        description="what GRPO compares within a group: episode (the rollouts' returns) or transition (each "
        "call's credited reward)",
    )
    credit: str = Field(
        default="broadcast",
        description="credit assignment from the episode and per-call rewards "
        "to each call: broadcast, discounted, intermediate, anchor (calls with the same prompt "
        "in a group compared with each other: fulmen.algorithm.rl.anchor)",
    )
    gamma: float = Field(default=1.0, gt=0, le=1, description="discount of the discounted/intermediate/anchor credit")
    anchor_weight: float = Field(
        default=1.0,
        ge=0,
        description="anchor credit: weight of the step advantage added to the episode advantage (GiGPO's omega)",
    )
    missing_reward: float = Field(default=0.0, description="reward of a transition/rollout that has none")
    rollout_timeout_s: float = Field(default=600.0, gt=0, le=7 * 24 * 3600, description="timeout_s of each request")
    max_attempts: int = Field(default=3, ge=1, le=100, description="max_attempts of each RolloutRequest")
    shuffle: bool = Field(default=True, description="shuffle the dataset each pass (seeded)")
    seed: int = Field(default=0, description="the run's seed: task order, rollout sampling, initialisation")
    val_every: int = Field(
        default=0,
        ge=0,
        description="validate every N steps (0 = only before step 1 and "
        "after the last, when a validation set is given)",
    )
    val_group_size: int = Field(default=1, ge=1, le=1024, description="rollouts per validation task")
    stop_at_val_accuracy: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="early stopping: end the run after the step whose held-out accuracy reaches this (validations "
        "every val_every steps; needs a validation set)",
    )
    consumer_group: str = Field(default="fulmen.trainer", description="the collector's consumer group")
    lr: float = Field(default=1e-5, gt=0, description="learning rate (AdamW)")
    micro_batch_size: int = Field(default=8, ge=1, description="rows per forward/backward pass")
    micro_batch_tokens: int = Field(
        default=0,
        ge=0,
        description="torch trainer: micro-batches of rows that share "
        "prefixes, at most this many distinct tokens each (a GRPO group's shared "
        "prompt and an episode's repeated turns computed once); 0 = micro_batch_size "
        "rows by length",
    )
    epochs_per_batch: int = Field(default=1, ge=1, description="passes over each step's samples (PPO epochs)")
    policy_loss: str = Field(default="ppo_clip", description="ppo_clip, dapo, gspo, cispo (fulmen.algorithm.rl.losses)")
    loss_aggregation: str = Field(
        default="token_mean",
        description="token_mean (over the batch's tokens) or "
        "seq_mean (each sequence's token mean, then over sequences)",
    )
    clip_eps: float = Field(default=0.2, gt=0, le=1, description="clip range below 1: ratio >= 1 - clip_eps")
    clip_eps_high: float | None = Field(
        default=None, gt=0, description="clip range above 1: ratio <= 1 + it; unset = clip_eps (the loss's own default)"
    )
    dynamic_sampling: bool = Field(
        default=False,
        description="DAPO: a group whose rewards are all equal is not "
        "trained on; the step waits for further groups instead",
    )
    dynamic_sampling_max_skipped: int = Field(
        default=0,
        ge=0,
        description="groups without signal one step may "
        "skip; past it the step takes groups as they come; "
        "0 = 10 * groups_per_step",
    )
    overlong_shaping: bool = Field(
        default=False, description="DAPO: penalise responses near the length limit (needs overlong_max_tokens)"
    )
    overlong_max_tokens: int = Field(
        default=0, ge=0, description="the response length limit of the agent's calls (their max_tokens)"
    )
    overlong_buffer_tokens: int = Field(
        default=0,
        ge=0,
        description="the penalty ramps up over this many tokens before the limit; 0 = overlong_max_tokens / 5",
    )
    overlong_penalty: float = Field(default=1.0, ge=0, description="the penalty at the limit and beyond")
    recompute_old_logprobs: bool = Field(
        default=False,
        description="the old policy's logprobs from the weights "
        "at the start of the step, not the recorded ones (a correction implies "
        "it)",
    )
    correction: str = Field(
        default="",
        description="off-policy correction between the recorded (behaviour) and "
        "recomputed (proximal) logprobs: '' (none; replay and async mode pick tis), tis, mis, decoupled, "
        "none (none, even for replay and async mode)",
    )
    correction_level: str = Field(
        default="token", description="token or sequence (the product of a response's token ratios)"
    )
    correction_low: float = Field(default=0.0, ge=0, description="mis: weights of ratios below it are set to 0")
    correction_high: float = Field(
        default=2.0, gt=0, description="tis: weights truncated to it; mis: weights of ratios above it set to 0"
    )
    kl_coef: float = Field(default=0.0, ge=0, description="weight of the KL penalty to the initial model; 0 = none")
    max_len: int | None = Field(
        default=None, ge=2, description="longest prompt + response a sample may have (tokens); unset = no limit"
    )
    lora_r: int = Field(
        default=0, ge=0, description="LoRA rank; 0 trains every weight (per_agent adapters: 0 = rank 16)"
    )
    adapters: AdapterMode = Field(
        default=AdapterMode.SHARED,
        description="shared: one policy for every trained "
        "agent; per_agent: one LoRA adapter per agent of adapter_agents on a frozen base, "
        "each trained on its agent's calls only (its own groups and advantages) and "
        "published as its own versions",
    )
    adapter_agents: str = Field(
        default="",
        description="per_agent: the agents that get an adapter "
        "(comma-separated names, as the transitions name them); their calls must "
        "name them too (.../agent/{name}/v1), or they get the base model",
    )
    device: str = Field(default="auto", description="auto, cpu, cuda or cuda:N")
    dtype: str = Field(default="auto", description="auto (bf16 on a GPU that has it, else float32), bfloat16, float32")
    backend: str = Field(
        default="torch",
        description="trainer backend: torch (one process, or FSDP2 over the "
        "ranks of a torchrun job) or verl (verl's FSDP engine and PPO loss, one process; needs "
        "verl installed)",
    )
    nproc: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="training ranks on this machine: above 1, `fulmen "
        "train` runs itself under torchrun (FSDP2; one rank per GPU, gloo on CPU); torchrun's PET_* "
        "variables (PET_NNODES, PET_RDZV_BACKEND, PET_RDZV_ENDPOINT) join several machines",
    )
    dist_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="how long a rank waits in a training collective for the others before the step fails",
    )
    shuffle_rewards: bool = Field(
        default=False,
        description="CONTROL RUNS ONLY: permute the rewards of each "
        "step's rollouts at random before the advantages, destroying the learning "
        "signal (a run that still improves learns from something else)",
    )
    warmup_teacher: str = Field(
        default="",
        description="module:function of a teacher, teach(task, messages) -> fulmen.testing.Reply: before the first "
        "step, the model is fine-tuned on the agent's episodes answered by it (fulmen.warmup; a small model that "
        "never earns a reward learns nothing from GRPO); needs --agent; empty: no warm-up",
    )
    warmup_steps: int = Field(
        default=8,
        ge=1,
        description="the warm-up's supervised updates (of 16 calls each): 8 taught SmolLM2-135M the calc agent's and "
        "the fulmen init project's format; 40 memorised the scaffold's 32 demonstrations and left GRPO less to learn",
    )
    warmup_tasks: int = Field(default=32, ge=1, description="the first N training tasks the teacher demonstrates")
    warmup_lr: float = Field(default=1e-4, gt=0, description="the warm-up's learning rate")
    warmup_sql: str = Field(
        default="",
        description="a read-only SELECT of stored rollout ids (e.g. the rewarded ones of an earlier run, or "
        "production traffic): before the first step (after the teacher's warm-up, if any), the model is fine-tuned "
        "on those rollouts' calls as stored (fulmen.warmup.stored_warm_up), read from source_store; empty: none",
    )
    report_to: Literal["tensorboard", "wandb", "mlflow", "none"] = Field(
        default="tensorboard",
        description="where each step's metrics go besides <run_dir>/metrics.jsonl and curves.png: TensorBoard event "
        "files in <run_dir>/tensorboard, Weights & Biases or MLflow (each installed and configured by you: their own "
        "WANDB_* / MLFLOW_* variables), or none",
    )
    publish_initial_version: bool = Field(
        default=False,
        description="publish the base model as version 0 at start, so gateways following the models topic serve it",
    )
    replay_sql: str = Field(
        default="",
        description="replay: train on the stored transitions of the rollouts this "
        "read-only SELECT returns (a column of rollout ids, and optionally a numeric one that orders "
        "them), with no new rollouts of them "
        "(fulmen.algorithm.service.replay); corrected with tis unless correction says mis, "
        "decoupled or none",
    )
    replay_fraction: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="replay with a dataset too: the share of "
        "each step's groups taken from the replayed ones (the rest on-policy)",
    )
    promote_if_better: bool = Field(
        default=False,
        description="validate every version and promote it (it serves "
        "gateways that follow promotions) only when it beats the serving version on the same held-out tasks: "
        "the promote_confidence interval of its per-task gain above promote_margin "
        "(fulmen.algorithm.service.promotion); needs a validation set",
    )
    promote_margin: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="--promote-if-better: the held-out accuracy "
        "gain (a share: 0.02 is two points) the whole interval must lie above",
    )
    promote_confidence: float = Field(
        default=0.95,
        ge=0.5,
        lt=1,
        description="--promote-if-better: the confidence of the paired interval of the gain (two-sided)",
    )
    tasks_sql: str = Field(
        default="",
        description="the tasks to dispatch: a read-only SELECT of task ids, "
        "their stored payloads (the tasks table) (fulmen.algorithm.service.stored_tasks)",
    )
    source_store: str = Field(
        default="",
        description="where replay_sql and tasks_sql read: '' = this deployment's "
        "store (FULMEN_CLICKHOUSE_*), an embedded store's directory (no process may hold it), "
        "or an http(s):// ClickHouse URL",
    )

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data: object) -> object:
        """Fill the pieces the algorithm prescribes and the input does not set (the recipe's defaults)."""
        if not isinstance(data, dict):
            return data
        name = data.get("algorithm", Algorithm.GRPO)
        try:
            recipe = ALGORITHMS.get(name)
        except ConfigurationError as exc:
            raise ValueError(f"FULMEN_TRAIN_ALGORITHM: {exc.message}") from None
        mode = {"correction": ASYNC_CORRECTION} if str(data.get("mode", "")) == TrainMode.ASYNC else {}
        merged = {**recipe.settings(), **mode, **data}
        if merged.get("replay_sql") and not merged.get("correction"):  # replay is off-policy by construction:
            merged["correction"] = ASYNC_CORRECTION  # never uncorrected (settings re-checked after a change too)
        return merged

    @field_validator("checkpoint_uri")
    @classmethod
    def _object_store(cls, value: str) -> str:
        if value and not value.startswith("s3://"):
            raise ValueError(f"FULMEN_TRAIN_CHECKPOINT_URI={value!r}: write s3://bucket/prefix (or leave it empty)")
        return value

    @field_validator("keep_checkpoints")
    @classmethod
    def _keeps_two(cls, value: int) -> int:
        if value == 1:
            raise ValueError(
                "FULMEN_TRAIN_KEEP_CHECKPOINTS=1 would remove the version a lagging gateway may still be loading; "
                "use 2 or more (or 0: keep every one)"
            )
        return value

    @field_validator("adapter_agents")
    @classmethod
    def _agent_names(cls, value: str) -> str:
        names = _names(value)
        for name in names:
            if not IDENTIFIER_PATTERN.fullmatch(name):
                raise ValueError(f"FULMEN_TRAIN_ADAPTER_AGENTS: {name!r} is not a valid identifier")
        if len(set(names)) < len(names):
            raise ValueError(f"FULMEN_TRAIN_ADAPTER_AGENTS: an agent is listed twice ({value})")
        return value

    @field_validator("credit")
    @classmethod
    def _registered(cls, value: str) -> str:
        try:
            credit_strategy(value)
        except ConfigurationError as exc:
            raise ValueError(f"FULMEN_TRAIN_CREDIT: {exc.message}") from None
        return value

    @model_validator(mode="after")
    def _bounds_fit(self) -> TrainSection:
        if self.min_group_size > self.group_size:
            raise ValueError(f"min_group_size ({self.min_group_size}) exceeds group_size ({self.group_size})")
        if self.backend == "verl" and self.nproc > 1:
            raise ValueError(
                "FULMEN_TRAIN_BACKEND=verl trains in one process; for FSDP over several ranks use "
                "FULMEN_TRAIN_BACKEND=torch with FULMEN_TRAIN_NPROC"
            )
        if self.max_groups_in_flight and self.max_groups_in_flight < self.groups_per_step:
            raise ValueError(
                f"max_groups_in_flight ({self.max_groups_in_flight}) below groups_per_step ({self.groups_per_step})"
                " would never fill a step; raise it or set 0 (= 2 * groups_per_step)"
            )
        if self.adapters is AdapterMode.PER_AGENT:
            if not self.adapter_agents:
                raise ValueError(
                    "FULMEN_TRAIN_ADAPTERS=per_agent needs the agents to train: set FULMEN_TRAIN_"
                    "ADAPTER_AGENTS=name1,name2 (the agent names of their calls)"
                )
            if self.backend != "torch" or self.nproc > 1:
                raise ValueError(
                    "FULMEN_TRAIN_ADAPTERS=per_agent trains with the torch backend in one process "
                    "(FULMEN_TRAIN_BACKEND=torch, FULMEN_TRAIN_NPROC=1)"
                )
        if self.correction_low > self.correction_high:
            raise ValueError(f"correction_low ({self.correction_low}) exceeds correction_high ({self.correction_high})")
        if self.overlong_max_tokens and self.overlong_buffer_tokens > self.overlong_max_tokens:
            raise ValueError(
                f"overlong_buffer_tokens ({self.overlong_buffer_tokens}) exceeds overlong_max_tokens "
                f"({self.overlong_max_tokens})"
            )
        return self

    @property
    def applied_correction(self) -> str | None:
        """The correction the trainer applies: None for '' and :data:`NO_CORRECTION`."""
        return None if self.correction in ("", NO_CORRECTION) else self.correction

    @property
    def overlong_limits(self) -> tuple[int, int, float] | None:
        """``(max_tokens, buffer_tokens, penalty)`` of the overlong shaping in force, None when it is off.

        Raises ConfigurationError when it is on without ``overlong_max_tokens`` (only the agent knows its limit)."""
        if not self.overlong_shaping:
            return None
        if not self.overlong_max_tokens:
            raise ConfigurationError(
                f"overlong shaping (on with FULMEN_TRAIN_ALGORITHM={self.algorithm}) needs the response length "
                "limit: set FULMEN_TRAIN_OVERLONG_MAX_TOKENS to the max_tokens your agent's calls ask for, or "
                "FULMEN_TRAIN_OVERLONG_SHAPING=false"
            )
        buffer = self.overlong_buffer_tokens or max(1, self.overlong_max_tokens // 5)
        return self.overlong_max_tokens, buffer, self.overlong_penalty

    @property
    def per_agent(self) -> list[str] | None:
        """The agents that get their own adapter (``adapters`` = per_agent), else None."""
        return _names(self.adapter_agents) if self.adapters is AdapterMode.PER_AGENT else None

    @property
    def step_advantage_weight(self) -> float | None:
        """The anchor credit's ``anchor_weight`` when ``credit`` is ``anchor`` (the samples then get step
        advantages, ``fulmen.algorithm.rl.anchor``), else None."""
        return self.anchor_weight if self.credit == CreditStrategy.ANCHOR else None

    @property
    def dynamic_sampling_bound(self) -> int:
        """How many groups without signal one step may skip (0 when dynamic sampling is off)."""
        if not self.dynamic_sampling:
            return 0
        return self.dynamic_sampling_max_skipped or 10 * self.groups_per_step

    @property
    def group_deadline_s(self) -> float:
        """How long after dispatch a group may still complete: ``group_timeout_s``, else long enough for every
        attempt of a rollout to time out (``rollout_timeout_s * max_attempts``), for the runners' backoff before
        each retry (at most ``FULMEN_RUNNER_RETRY_BACKOFF_MAX_S``, 60 s by default, plus its jitter), plus a
        minute."""
        retries = self.max_attempts - 1
        return self.group_timeout_s or self.rollout_timeout_s * self.max_attempts + 72.0 * retries + 60.0

    @property
    def groups_in_flight(self) -> int:
        """The bound on dispatched, unfinished train groups: ``max_groups_in_flight``, else two steps' worth
        (synchronous) or ``max_staleness + 1`` steps' worth, at least two (asynchronous: what can still be trained
        on when it arrives)."""
        if self.max_groups_in_flight:
            return self.max_groups_in_flight
        if self.mode is TrainMode.ASYNC:
            return max(self.max_staleness + 1, 2) * self.groups_per_step
        return 2 * self.groups_per_step


class TrainSettings(FulmenSettings):
    train: TrainSection = Field(default_factory=TrainSection)

    @property
    def run_dir(self) -> Path:
        """Where this run writes: ``FULMEN_TRAIN_RUN_DIR``, else ``$FULMEN_HOME/runs/<run_id>``."""
        return self.train.run_dir or self.home / "runs" / self.train.run_id
