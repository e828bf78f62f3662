"""Settings of the runner process: the shared sections plus ``FULMEN_RUNNER_*``."""

from __future__ import annotations

from pydantic import BaseModel, Field

from infra.settings import FulmenSettings

__all__ = ["RunnerSection", "RunnerSettings"]


class RunnerSection(BaseModel):
    agent: str = Field(default="", description="module:function of the agent to run")
    concurrency: int = Field(default=4, ge=1, le=1024, description="rollouts run at once by one runner")
    group: str = Field(default="fulmen.runners", description="the runners' consumer group")
    llm_base_url: str = Field(default="http://127.0.0.1:8000", description="the LLM gateway agents call")
    model: str = Field(default="fulmen", description="the model name handed to agents")
    otlp_endpoint: str = Field(default="http://127.0.0.1:4318/v1/traces", description="'' = do not export spans")
    shutdown_grace_s: float = Field(default=30.0, ge=0, description="on SIGTERM, time to finish running rollouts")


class RunnerSettings(FulmenSettings):
    runner: RunnerSection = Field(default_factory=RunnerSection)
