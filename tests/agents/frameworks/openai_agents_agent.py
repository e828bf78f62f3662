"""An OpenAI Agents SDK agent as a user writes one: one ``Agent`` with one function tool, run by ``Runner.run``.

Signature ``async add_numbers(task, llm) -> float``. ``task`` may hold ``question`` (str). The model is an
``OpenAIChatCompletionsModel`` over ``openai.AsyncOpenAI(base_url=llm.base_url)``: Chat Completions, never the
Responses API (the Fulmen gateway does not serve it). ``max_turns=3`` and ``max_retries=0`` bound a run to at
most 3 chat completions. Reward: 1.0 when the run ends with a non-empty final output; 0.0 when it gives up: the
SDK raises an ``AgentsException`` (``ModelBehaviorError`` for a tool that does not exist, ``MaxTurnsExceeded``
when the model keeps calling the tool with arguments that are not JSON, each answered with an error message),
caught here as a user would.

Tracing is the framework's own: openinference's ``OpenAIAgentsInstrumentor`` with ``exclusive_processor=True``,
which *replaces* the SDK's trace processors, so the default exporter to OpenAI's servers is gone and nothing
leaves the machine. (``set_tracing_disabled(True)`` is the wrong switch: it stops the SDK's tracing altogether,
the OpenTelemetry spans included.) Installed once per process, on the first call. It imports nothing of Fulmen's.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import openai
from agents import Agent, AgentsException, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor

__all__ = ["AGENT_NAME", "MAX_TURNS", "add_numbers"]

logger = logging.getLogger(__name__)

AGENT_NAME = "calculator"
MAX_TURNS = 3
_instrumented = False
_instrument_lock = threading.Lock()


def instrument_once() -> None:
    """Route the SDK's traces to OpenTelemetry (and only there), the first time only."""
    global _instrumented
    with _instrument_lock:
        if not _instrumented:
            OpenAIAgentsInstrumentor().instrument(exclusive_processor=True)
            _instrumented = True


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


def build_agent(llm: Any) -> Agent:
    """The agent, with a model client scoped to this rollout's endpoint."""
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=120)
    return Agent(
        name=AGENT_NAME,
        instructions="Use the add tool to compute sums, then answer with the number.",
        tools=[add],
        model=OpenAIChatCompletionsModel(model=llm.model, openai_client=client),
    )


async def add_numbers(task: dict[str, Any], llm: Any) -> float:
    """One run of the agent on ``task['question']``; see the module docstring for the reward."""
    instrument_once()
    question = str(task.get("question", "What is 2 + 2?"))
    config = RunConfig(workflow_name="add_numbers", tracing_disabled=False)
    try:
        result = await Runner.run(build_agent(llm), question, max_turns=MAX_TURNS, run_config=config)
    except AgentsException as exc:
        logger.debug("openai-agents run gave up: %s: %s", type(exc).__name__, exc)
        return 0.0
    return 1.0 if str(result.final_output or "").strip() else 0.0
