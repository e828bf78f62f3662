"""The agent runner: a consumer group over the tasks topic that runs the user's agent, rollout by rollout."""

from fulmen.producers.runner.settings import RunnerSection, RunnerSettings
from fulmen.schemas.lazy import lazy_exports

__all__ = ["LLMEndpoint", "Runner", "RunnerSection", "RunnerSettings", "load_agent"]

# The server on first use: its settings alone (what `fulmen --help` reads) import no server.
__getattr__, __dir__ = lazy_exports(
    globals(),
    {
        "LLMEndpoint": "fulmen.producers.runner.agent",
        "load_agent": "fulmen.producers.runner.agent",
        "Runner": "fulmen.producers.runner.app",
    },
)
