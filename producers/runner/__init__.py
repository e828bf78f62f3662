"""The agent runner: a consumer group over the tasks topic that runs the user's agent, rollout by rollout."""

from fulmen.producers.runner.agent import LLMEndpoint, load_agent
from fulmen.producers.runner.app import Runner
from fulmen.producers.runner.settings import RunnerSection, RunnerSettings

__all__ = ["LLMEndpoint", "Runner", "RunnerSection", "RunnerSettings", "load_agent"]
