"""The agent runner: a consumer group over the tasks topic that runs the user's agent, rollout by rollout."""

from producers.runner.agent import LLMEndpoint, load_agent
from producers.runner.app import Runner
from producers.runner.settings import RunnerSection, RunnerSettings

__all__ = ["LLMEndpoint", "Runner", "RunnerSection", "RunnerSettings", "load_agent"]
