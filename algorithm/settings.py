"""Settings of the training process (``fulmen train``): the shared sections plus ``FULMEN_TRAIN_*``.

A variable is ``FULMEN_TRAIN_<FIELD>``: ``FULMEN_TRAIN_GROUP_SIZE=8``, ``FULMEN_TRAIN_GROUPS_PER_STEP=4``,
``FULMEN_TRAIN_LR=1e-5``, ``FULMEN_TRAIN_MAX_STALENESS=1``, ``FULMEN_TRAIN_GROUP_TIMEOUT_S=300``,
``FULMEN_TRAIN_INCOMPLETE_POLICY=train_partial``, ``FULMEN_TRAIN_ESTIMATOR=grpo``, ``FULMEN_TRAIN_MODEL_PATH=...``,
``FULMEN_TRAIN_RUN_DIR=...``, ``FULMEN_TRAIN_STEPS=100``.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, Field, field_validator, model_validator

from fulmen.algorithm.credit import credit_strategy
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import IDENTIFIER_PATTERN, new_id

__all__ = ["AdvantageScope", "IncompletePolicy", "TrainSection", "TrainSettings"]


class IncompletePolicy(StrEnum):
    """What to do with a group still missing rollouts when its timeout passes (see ``fulmen.algorithm.groups``)."""

    TRAIN_PARTIAL = "train_partial"  # train on the rollouts that arrived (at least min_group_size of them)
    DROP = "drop"  # drop the whole group


class AdvantageScope(StrEnum):
    """Which rewards the advantage estimator compares within a group (see ``fulmen.algorithm.samples``)."""

    EPISODE = "episode"  # the rollouts' returns, broadcast to each rollout's transitions
    TRANSITION = "transition"  # every transition's credited reward against all transitions of the group


class TrainSection(BaseModel):
    """``FULMEN_TRAIN_*``: the dataset, the policy update, the group and staleness policies, the outputs."""

    run_id: str = Field(default_factory=lambda: f"run-{new_id()[:12]}", pattern=IDENTIFIER_PATTERN.pattern)
    run_dir: Path | None = Field(default=None, description="checkpoints go to <run_dir>/checkpoints/v<N>; "
                                 "default $FULMEN_HOME/runs/<run_id>")  # fmt: skip
    model_path: str = Field(default="", description="Hugging Face model directory, or 'tiny' (built offline)")
    model_name: str = Field(default="fulmen", pattern=IDENTIFIER_PATTERN.pattern, description="served name")
    agent: str = Field(default="", pattern=r"^$|^[\w.]+:[\w.]+$",
                       description="module:function the runners run (recorded in request metadata)")  # fmt: skip
    steps: int = Field(default=10, ge=1, description="the run's last step (= model version); a resumed run "
                       "continues up to it")  # fmt: skip
    group_size: int = Field(default=8, ge=1, le=1024, description="rollouts per task (GRPO's G)")
    groups_per_step: int = Field(default=4, ge=1, description="complete groups in one optimisation step")
    max_groups_in_flight: int = Field(default=0, ge=0, description="dispatched, unfinished groups; "
                                      "0 = 2 * groups_per_step")  # fmt: skip
    min_group_size: int = Field(default=2, ge=1, description="fewest rollouts a timed-out group trains on")
    group_timeout_s: float = Field(default=0.0, ge=0, description="from dispatch to giving up on the rest; "
                                   "0 = every attempt's timeout plus a minute")  # fmt: skip
    incomplete_policy: IncompletePolicy = IncompletePolicy.TRAIN_PARTIAL
    max_staleness: int = Field(default=1, ge=0, description="train on transitions of versions >= current - this")
    estimator: str = Field(default="grpo", description="advantage estimator: grpo, dr_grpo, rloo")
    advantage_scope: AdvantageScope = AdvantageScope.EPISODE
    credit: str = Field(default="broadcast", description="credit assignment from the episode and per-call rewards "
                        "to each call: broadcast, discounted, intermediate (fulmen.algorithm.credit)")  # fmt: skip
    gamma: float = Field(default=1.0, gt=0, le=1, description="discount of the discounted/intermediate credit")
    missing_reward: float = Field(default=0.0, description="reward of a transition/rollout that has none")
    rollout_timeout_s: float = Field(default=600.0, gt=0, le=7 * 24 * 3600, description="timeout_s of each request")
    max_attempts: int = Field(default=3, ge=1, le=100, description="max_attempts of each RolloutRequest")
    shuffle: bool = Field(default=True, description="shuffle the dataset each pass (seeded)")
    seed: int = 0
    val_every: int = Field(default=0, ge=0, description="validate every N steps (0 = only before step 1 and "
                           "after the last, when a validation set is given)")  # fmt: skip
    val_group_size: int = Field(default=1, ge=1, le=1024)
    consumer_group: str = Field(default="fulmen.trainer", description="the collector's consumer group")
    lr: float = Field(default=1e-5, gt=0)
    micro_batch_size: int = Field(default=8, ge=1)
    epochs_per_batch: int = Field(default=1, ge=1)
    clip_eps: float = Field(default=0.2, gt=0, lt=1)
    kl_coef: float = Field(default=0.0, ge=0)
    max_len: int | None = Field(default=None, ge=2)
    lora_r: int = Field(default=0, ge=0, description="LoRA rank; 0 trains every weight")
    device: str = "auto"
    dtype: str = "auto"
    backend: str = Field(default="torch", description="trainer backend: torch (one process, or FSDP2 over the "
                         "ranks of a torchrun job) or verl (verl's FSDP engine and PPO loss, one process; needs "
                         "verl installed)")  # fmt: skip
    nproc: int = Field(default=1, ge=1, le=1024, description="training ranks on this machine: above 1, `fulmen "
                       "train` runs itself under torchrun (FSDP2; one rank per GPU, gloo on CPU); torchrun's PET_* "
                       "variables (PET_NNODES, PET_RDZV_BACKEND, PET_RDZV_ENDPOINT) join several machines")  # fmt: skip
    dist_timeout_s: float = Field(default=600.0, gt=0, description="how long a rank waits in a training "
                                  "collective for the others before the step fails")  # fmt: skip
    shuffle_rewards: bool = Field(default=False, description="CONTROL RUNS ONLY: permute the rewards of each "
                                  "step's rollouts at random before the advantages, destroying the learning "
                                  "signal (a run that still improves learns from something else)")  # fmt: skip
    publish_initial_version: bool = Field(default=False, description="publish the base model as version 0 at "
                                          "start, so gateways following the models topic serve it")  # fmt: skip

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
            raise ValueError("FULMEN_TRAIN_BACKEND=verl trains in one process; for FSDP over several ranks use "
                             "FULMEN_TRAIN_BACKEND=torch with FULMEN_TRAIN_NPROC")  # fmt: skip
        if self.max_groups_in_flight and self.max_groups_in_flight < self.groups_per_step:
            raise ValueError(
                f"max_groups_in_flight ({self.max_groups_in_flight}) below groups_per_step ({self.groups_per_step})"
                " would never fill a step; raise it or set 0 (= 2 * groups_per_step)"
            )
        return self

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
        """The bound on dispatched, unfinished train groups."""
        return self.max_groups_in_flight or 2 * self.groups_per_step


class TrainSettings(FulmenSettings):
    train: TrainSection = Field(default_factory=TrainSection)

    @property
    def run_dir(self) -> Path:
        """Where this run writes: ``FULMEN_TRAIN_RUN_DIR``, else ``$FULMEN_HOME/runs/<run_id>``."""
        return self.train.run_dir or self.home / "runs" / self.train.run_id
