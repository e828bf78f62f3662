"""An AutoGen AgentChat agent as a user writes one: an ``AssistantAgent`` with one tool, run on one task.

Signature ``async multiply_numbers(task, llm) -> float``. ``task`` may hold ``question`` (str) and ``stream``
(bool: ``model_client_stream``). The model client is ``OpenAIChatCompletionClient`` with an explicit
``model_info`` (the gateway's model name is not one AutoGen knows). ``max_tool_iterations=1`` with
``reflect_on_tool_use=True`` bounds a run to 2 chat completions (the tool call, then the answer);
``max_retries=0`` keeps one HTTP request per call. A tool the model invents, or arguments that are not JSON,
come back to the model as an error result (AutoGen does not raise); anything the framework does raise on a bad
answer is caught (``ValueError``, which covers pydantic's validation errors) and scores 0.0. Reward: 1.0 when the
final message has non-empty text, else 0.0.

Tracing, two parts, both on the global tracer provider:

* AutoGen's own: ``autogen_core`` opens gen_ai spans itself (``create_agent``, ``invoke_agent``,
  ``execute_tool``) with ``trace.get_tracer("autogen-core")``; nothing to switch on (the environment variable
  ``AUTOGEN_DISABLE_RUNTIME_TRACING=true`` switches off the runtime's own spans, which a team adds).
* LLM calls: AutoGen's OpenAI client opens no span (it only logs an ``LLMCallEvent``), so, as AutoGen's
  tracing guide does, this agent turns on the OpenTelemetry instrumentation of the ``openai`` client
  (``opentelemetry-instrumentation-openai-v2``), once per process. That patches every ``openai`` client in the
  process, not only this agent's.

It imports nothing of Fulmen's.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.messages import BaseTextChatMessage
from autogen_core.models import ModelFamily, ModelInfo
from autogen_ext.models.openai import OpenAIChatCompletionClient

__all__ = ["AGENT_NAME", "multiply_numbers"]

logger = logging.getLogger(__name__)

AGENT_NAME = "multiplier"
MODEL_INFO = ModelInfo(
    vision=False,
    function_calling=True,
    json_output=False,
    structured_output=False,
    family=ModelFamily.UNKNOWN,
    multiple_system_messages=True,
)
_instrumented = False
_instrument_lock = threading.Lock()


def instrument_once() -> None:
    """Trace the ``openai`` client's chat completions (AutoGen's own spans need nothing), the first time only."""
    global _instrumented
    with _instrument_lock:
        if _instrumented:
            return
        _instrumented = True
        try:
            from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
        except ImportError as exc:
            logger.warning("no LLM-call spans for AutoGen: the openai client instrumentation cannot load (%s)", exc)
            return
        OpenAIInstrumentor().instrument()


async def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def build_agent(llm: Any, stream: bool) -> tuple[AssistantAgent, OpenAIChatCompletionClient]:
    """The agent and its model client (to be closed after the run), scoped to this rollout's endpoint."""
    client = OpenAIChatCompletionClient(
        model=llm.model,
        base_url=llm.base_url,
        api_key=llm.api_key,
        model_info=MODEL_INFO,
        max_retries=0,
        timeout=120,
        max_tokens=64,
    )
    agent = AssistantAgent(
        name=AGENT_NAME,
        model_client=client,
        tools=[multiply],
        system_message="Use the multiply tool, then answer with the number.",
        reflect_on_tool_use=True,
        max_tool_iterations=1,
        model_client_stream=stream,
    )
    return agent, client


async def multiply_numbers(task: dict[str, Any], llm: Any) -> float:
    """One run of the agent on ``task['question']``; see the module docstring for the reward."""
    instrument_once()
    agent, client = build_agent(llm, bool(task.get("stream", False)))
    try:
        result = await agent.run(task=str(task.get("question", "What is 3 times 4?")))
    except ValueError as exc:
        logger.debug("autogen run gave up: %s: %s", type(exc).__name__, exc)
        return 0.0
    finally:
        await client.close()
    last = result.messages[-1] if result.messages else None
    text = last.content if isinstance(last, BaseTextChatMessage) else ""
    return 1.0 if text.strip() else 0.0
