"""Settings of the runner process: the shared sections plus ``FULMEN_RUNNER_*``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, SecretStr

from fulmen.infra.settings import FulmenSettings

__all__ = ["RunnerSection", "RunnerSettings"]


class RunnerSection(BaseModel):
    """``FULMEN_RUNNER_*``: what the runner runs, where its agents' LLM calls and spans go, its consumer group."""

    agent: str = Field(default="", description="module:function of the agent to run")
    concurrency: int = Field(default=4, ge=1, le=1024, description="rollouts run at once by one runner")
    group: str = Field(
        default="fulmen.runners",
        description="the runners' consumer group; the default takes FULMEN_KAFKA_TOPIC_PREFIX, another name is "
        "used as given",
    )
    llm_base_url: str = Field(
        default="http://127.0.0.1:8000",
        description="the LLM gateway agents call (each rollout gets <url>/rollout/<id>/attempt/<n>/v1)",
    )
    model: str = Field(default="fulmen", description="the model name handed to agents")
    llm_api_key: SecretStr = Field(
        default=SecretStr("fulmen"),
        description="the api_key handed to agents: the LLM gateway's FULMEN_LLM_BEARER_TOKEN when it requires one",
    )
    otlp_endpoint: str = Field(
        default="http://127.0.0.1:4318/v1/traces", description="where the agents' spans go (OTLP/HTTP); '' = nowhere"
    )
    span_export: Literal["kafka", "otlp"] = Field(
        default="kafka",
        description="how the spans of agents that run in the runner's process reach Fulmen: kafka writes them "
        "straight into the spans topic as the OTLP gateway would (no HTTP hop); otlp posts them to otlp_endpoint. "
        "Agents in their own processes and tracer providers the agent sets up itself use otlp_endpoint either way",
    )
    retry_backoff_s: float = Field(
        default=2.0,
        ge=0,
        le=3600,
        description="wait before retrying a failed or timed-out attempt, doubled for each further attempt "
        "(carried on the retry as a not-before time; other rollouts run meanwhile); 0 = retry at once",
    )
    retry_backoff_max_s: float = Field(default=60.0, ge=0, le=24 * 3600, description="longest wait before a retry")
    retry_jitter: float = Field(
        default=0.2, ge=0, le=1, description="up to this fraction of the wait is added at random (spreads retries)"
    )
    shutdown_grace_s: float = Field(default=30.0, ge=0, description="on SIGTERM, time to finish running rollouts")
    sync_isolation: Literal["thread", "process"] = Field(
        default="thread",
        description="where sync agents run: thread (cannot be stopped when they time out) or process (one "
        "process per rollout, killed on timeout)",
    )
    sync_threads: int = Field(
        default=0,
        ge=0,
        le=4096,
        description="thread isolation: most sync agents running at once, timed-out ones included; 0 = 2 x concurrency",
    )

    @property
    def longest_retry_wait_s(self) -> float:
        """The most a runner holds a retry before starting it, whatever not-before time the request names."""
        return self.retry_backoff_max_s * (1.0 + self.retry_jitter)

    @property
    def max_sync_threads(self) -> int:
        return self.sync_threads or 2 * self.concurrency


class RunnerSettings(FulmenSettings):
    runner: RunnerSection = Field(default_factory=RunnerSection)
