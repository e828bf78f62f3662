"""The agent runner: a consumer group over the tasks topic that runs the user's agent, rollout by rollout."""

from typing import Any

from fulmen.producers.runner.settings import RunnerSection, RunnerSettings

__all__ = ["LLMEndpoint", "Runner", "RunnerSection", "RunnerSettings", "load_agent"]


def __getattr__(name: str) -> Any:
    """The runner itself on first use: its settings alone (what ``fulmen --help`` reads) import no agent code."""
    if name in ("LLMEndpoint", "load_agent"):
        from fulmen.producers.runner import agent

        return getattr(agent, name)
    if name == "Runner":
        from fulmen.producers.runner.app import Runner

        return Runner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
