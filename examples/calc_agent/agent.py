"""The calc agent: an AutoGen AgentChat ``AssistantAgent`` named ``solver`` with a calculator tool.

Plain AutoGen code; the Fulmen-specific lines are the ``base_url`` the runner hands it (``llm.base_url``) and the
OpenTelemetry set-up AutoGen's tracing guide gives: AutoGen opens its own gen_ai spans (``invoke_agent solver``,
``execute_tool calculator``) on the global tracer provider, and the ``openai`` client instrumentation records each
LLM call (``opentelemetry-instrumentation-openai-v2``; where it cannot import, the gateway's own span of each
call is all there is, which is what Fulmen trains on anyway).

One episode: the question; the model calls ``calculator`` as often as it needs (at most ``MAX_TOOL_ROUNDS``
rounds), AutoGen feeds the results back, then one reflection call writes the answer. So at most
``MAX_TOOL_ROUNDS + 1`` LLM calls; no retries. Reward: 1.0 when the answer's last number is right (``reward``).
A model that writes noise, calls a tool that does not exist or sends arguments that are not JSON gets an error
result back (AutoGen does not raise), and the episode still ends with a reward.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.messages import BaseTextChatMessage
from autogen_core.models import ModelFamily, ModelInfo
from autogen_ext.models.openai import OpenAIChatCompletionClient

from examples.calc_agent.calculator import CalcError, calculate, format_number
from examples.calc_agent.reward import reward

__all__ = ["AGENT_NAME", "MAX_CALLS", "calculator", "run"]

logger = logging.getLogger(__name__)

AGENT_NAME = "solver"
MAX_TOOL_ROUNDS = 2
MAX_CALLS = MAX_TOOL_ROUNDS + 1
DEFAULT_MAX_TOKENS = 96
SYSTEM = "Solve the problem. Use the calculator tool for the arithmetic, then reply with the final number."
MODEL_INFO = ModelInfo(
    vision=False,
    function_calling=True,
    json_output=False,
    structured_output=False,
    family=ModelFamily.UNKNOWN,
    multiple_system_messages=True,
)
_instrumented = False
_lock = threading.Lock()


def instrument_once() -> None:
    """Trace the ``openai`` client's calls (AutoGen's own spans need nothing), once per process."""
    global _instrumented
    with _lock:
        if _instrumented:
            return
        _instrumented = True
        try:
            from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
        except ImportError as exc:
            logger.warning("no openai client spans (the instrumentation cannot load: %s)", exc)
            return
        OpenAIInstrumentor().instrument()


async def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. 12*8-30."""
    try:
        return format_number(calculate(expression))
    except CalcError as exc:
        return f"error: {exc}"


async def run(task: dict[str, Any], llm: Any) -> float:
    """One episode on ``task["question"]``; 1.0 when the final number equals ``task["answer"]``."""
    instrument_once()
    client = OpenAIChatCompletionClient(
        model=llm.model,
        base_url=llm.base_url,
        api_key=llm.api_key,
        model_info=MODEL_INFO,
        max_retries=0,
        timeout=300,
        max_tokens=int(task.get("max_tokens", DEFAULT_MAX_TOKENS)),
        temperature=0.0 if task.get("greedy") else 1.0,
    )
    agent = AssistantAgent(
        name=AGENT_NAME,
        model_client=client,
        tools=[calculator],
        system_message=SYSTEM,
        reflect_on_tool_use=True,
        max_tool_iterations=MAX_TOOL_ROUNDS,
    )
    try:
        result = await agent.run(task=str(task["question"]))
    except ValueError as exc:  # what AutoGen raises on a reply it cannot read (pydantic's errors included)
        logger.debug("calc episode gave up: %s", exc)
        return 0.0
    finally:
        await client.close()
    last = result.messages[-1] if result.messages else None
    text = last.content if isinstance(last, BaseTextChatMessage) else ""
    return reward(text, task["answer"])
