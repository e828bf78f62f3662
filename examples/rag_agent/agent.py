"""The RAG agent: an OpenAI Agents SDK ``Agent`` named ``researcher`` with a ``search`` tool over the corpus.

Plain Agents SDK code; the Fulmen-specific lines are the ``base_url`` the runner hands it, the OpenTelemetry
instrumentation the SDK's users turn on (openinference's ``OpenAIAgentsInstrumentor`` with
``exclusive_processor=True``: spans go to OpenTelemetry only, nothing to OpenAI's servers) and one
``fulmen.emit_reward(0.1)`` in the tool: a search that returns a document on the question's gold path (the first
time in the episode for that document) is an intermediate reward, credited to the call that asked for the
search (the ``intermediate`` credit strategy).

An episode: the model searches (each ``search`` returns the two best documents) and answers; at most
``MAX_TURNS`` LLM calls (``max_turns``), no retries. Reward: token F1 of the final answer against the gold
answer. A model that invents a tool, sends arguments that are not JSON until the turn limit, or writes noise
ends the episode with an empty or wrong answer (the SDK's ``AgentsException`` is caught), never an exception.
"""

from __future__ import annotations

import threading
from typing import Any

import openai
from agents import Agent, AgentsException, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
from agents.model_settings import ModelSettings
from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor

import fulmen
from examples.rag_agent.reward import token_f1
from examples.rag_agent.search import search

__all__ = ["AGENT_NAME", "HIT_REWARD", "MAX_TURNS", "run"]

AGENT_NAME = "researcher"
MAX_TURNS = 4
HIT_REWARD = 0.1
DEFAULT_MAX_TOKENS = 64
INSTRUCTIONS = (
    "Answer the question. Use the search tool to find facts, one search per fact. Reply with the answer only."
)
_instrumented = False
_lock = threading.Lock()


def instrument_once() -> None:
    global _instrumented
    with _lock:
        if not _instrumented:
            OpenAIAgentsInstrumentor().instrument(exclusive_processor=True)
            _instrumented = True


def search_tool(gold_docs: list[str]) -> Any:
    """This episode's ``search`` tool: it remembers which gold documents it already rewarded."""
    rewarded: set[str] = set()

    @function_tool
    def search_documents(query: str) -> str:
        """Search the documents.

        Args:
            query: words to look for.
        """
        hits = search(query)
        for doc_id, _ in hits:
            if doc_id in gold_docs and doc_id not in rewarded:
                rewarded.add(doc_id)
                fulmen.emit_reward(HIT_REWARD, name="gold_document")
        return "\n".join(f"[{doc_id}] {text}" for doc_id, text in hits) or "no document matches"

    search_documents.name = "search"
    return search_documents


async def run(task: dict[str, Any], llm: Any) -> float:
    """One episode on ``task["question"]``; the token F1 of the answer against ``task["answer"]``."""
    instrument_once()
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=300)
    settings = ModelSettings(
        temperature=0.0 if task.get("greedy") else 1.0, max_tokens=int(task.get("max_tokens", DEFAULT_MAX_TOKENS))
    )
    model = OpenAIChatCompletionsModel(model=llm.model, openai_client=client)
    tools = [search_tool(list(task.get("gold_docs", [])))]
    agent = Agent(name=AGENT_NAME, instructions=INSTRUCTIONS, tools=tools, model=model, model_settings=settings)
    try:
        result = await Runner.run(
            agent, str(task["question"]), max_turns=MAX_TURNS, run_config=RunConfig(workflow_name="rag_agent")
        )
        answer = str(result.final_output or "")
    except AgentsException:
        answer = ""
    finally:
        await client.close()
    return token_f1(answer, str(task["answer"]))
