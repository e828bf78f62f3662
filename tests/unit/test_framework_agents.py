"""Real agent frameworks against a stand-in OpenAI server: each agent runs, and its own instrumentation emits the
LLM-call spans (and agent / node names) the transitions consumer will look for.

Every rollout runs as the runner runs it: the global tracer provider from ``build_tracer_provider`` (so the
rollout stamper is on), ``CURRENT_ROLLOUT`` set, a root span, then ``call_agent``. Spans are captured in memory
and selected by the root's trace id. The span trees asserted here are described in
``tests/agents/frameworks/__init__.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("langgraph", reason="langgraph is not installed (pip install -e '.[frameworks]')")
pytest.importorskip("agents", reason="openai-agents is not installed (pip install -e '.[frameworks]')")
pytest.importorskip("autogen_agentchat", reason="autogen-agentchat is not installed (pip install -e '.[frameworks]')")

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fulmen.producers.runner.agent import LLMEndpoint, call_agent
from fulmen.producers.runner.tracing import CURRENT_ROLLOUT, build_tracer_provider
from fulmen.schemas import semconv
from fulmen.schemas.events import RolloutRequest
from tests.agents.frameworks import autogen_agent, langgraph_agent, openai_agents_agent
from tests.agents.frameworks.fake_openai import FakeOpenAI, RecordedRequest

pytestmark = pytest.mark.frameworks

MODEL = "tiny-test-model"


try:
    from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor  # noqa: F401

    OPENAI_V2 = True
except ImportError:
    OPENAI_V2 = False
OPENAI_V2_MISSING = (
    "opentelemetry-instrumentation-openai-v2 does not import here (2.4b0 needs opentelemetry.util.genai.instruments, "
    "which opentelemetry-util-genai 1.x no longer has; 0.4b0 has it): AutoGen 0.7 opens no LLM span of its own"
)


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """The runner's global provider (rollout stamper included) with an in-memory exporter added for this module."""
    build_tracer_provider(None)
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        pytest.fail(f"the global tracer provider is a {type(provider).__name__}, not the SDK's")
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    yield memory
    memory.shutdown()  # the processor stays on the global provider; a shut-down exporter keeps nothing


@dataclass
class Rollout:
    """One finished rollout: the agent's reward, its spans (one trace), and what the LLM server received."""

    rollout_id: str
    reward: float | None
    spans: list[ReadableSpan]
    requests: list[RecordedRequest]

    @property
    def root(self) -> ReadableSpan:
        return next(s for s in self.spans if s.name == "rollout")

    def parent(self, span: ReadableSpan) -> ReadableSpan | None:
        return next((s for s in self.spans if span.parent and s.context.span_id == span.parent.span_id), None)

    def ancestors(self, span: ReadableSpan) -> list[ReadableSpan]:
        chain, current = [], self.parent(span)
        while current is not None:
            chain.append(current)
            current = self.parent(current)
        return chain

    def where(self, **attributes: Any) -> list[ReadableSpan]:
        found = [s for s in self.spans if all((s.attributes or {}).get(k) == v for k, v in attributes.items())]
        return sorted(found, key=lambda s: s.start_time or 0)


async def run_rollout(
    exporter: InMemorySpanExporter, server: FakeOpenAI, agent: Callable[..., Any], task: dict[str, Any], name: str
) -> Rollout:
    """Run ``agent`` once as the runner does, on ``server`` behind a rollout-scoped base URL."""
    request = RolloutRequest(rollout_id=name, task_id="task", group_id="group", input=task)
    llm = LLMEndpoint(base_url=server.url(f"/rollout/{name}/attempt/1"), model=MODEL, api_key="fulmen")
    token = CURRENT_ROLLOUT.set(request)
    try:
        with trace.get_tracer("fulmen.runner").start_as_current_span("rollout") as root:
            reward = await call_agent(agent, task, llm)
    finally:
        CURRENT_ROLLOUT.reset(token)
    trace_id = root.get_span_context().trace_id
    spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
    requests = [r for r in server.chat_requests() if r.path.startswith(f"/rollout/{name}/")]
    return Rollout(name, reward, spans, requests)


def assert_runner_invariants(rollout: Rollout) -> None:
    """Every span is in the root's tree and stamped with the rollout; no request carried a traceparent."""
    for span in rollout.spans:
        if span is not rollout.root and rollout.root not in rollout.ancestors(span):
            raise AssertionError(f"span {span.name!r} is not under the rollout span")
        assert (span.attributes or {}).get(semconv.ROLLOUT_ID) == rollout.rollout_id, span.name
    # None of the three frameworks (nor the openai client) injects W3C trace context into its HTTP requests. If
    # this fails, one now does: the gateway can parent its spans on the agent's; update the report in
    # tests/agents/frameworks/__init__.py.
    assert [r for r in rollout.requests if "traceparent" in r.headers] == []


def llm_spans_openinference(rollout: Rollout) -> list[ReadableSpan]:
    return rollout.where(**{semconv.OPENINFERENCE_SPAN_KIND: "LLM"})


# --- LangGraph ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_langgraph_one_llm_span_per_node_with_node_name(exporter: InMemorySpanExporter, stream: bool) -> None:
    with FakeOpenAI("tool_then_text") as server:
        rollout = await run_rollout(exporter, server, langgraph_agent.write_check_rewrite, {"stream": stream}, "lg")
    assert rollout.reward == 1.0
    assert [r.body.get("stream", False) for r in rollout.requests] == [stream] * 3
    assert_runner_invariants(rollout)
    llm = llm_spans_openinference(rollout)
    assert len(llm) == 3
    nodes = [json.loads(s.attributes[semconv.OPENINFERENCE_METADATA])["langgraph_node"] for s in llm]
    assert nodes == ["write", "check", "rewrite"]
    for span, node in zip(llm, nodes, strict=True):
        assert span.name == "ChatOpenAI"
        assert span.attributes[semconv.OPENINFERENCE_LLM_MODEL_NAME] == MODEL
        assert span.attributes[semconv.OPENINFERENCE_LLM_TOKEN_COUNT_COMPLETION] > 0
        node_span, graph_span, root = rollout.ancestors(span)
        assert (node_span.name, node_span.attributes[semconv.OPENINFERENCE_SPAN_KIND]) == (node, "CHAIN")
        assert json.loads(node_span.attributes[semconv.OPENINFERENCE_METADATA])["langgraph_node"] == node
        assert (graph_span.name, root.name) == ("write_check_rewrite", "rollout")
    # Selecting the calls of chosen nodes is a filter on that metadata key.
    chosen = [s for s in llm if json.loads(s.attributes[semconv.OPENINFERENCE_METADATA])["langgraph_node"] != "check"]
    assert len(chosen) == 2
    # The response id reaches the span only inside output.value (LangChain's response_metadata).
    ids = [json.loads(s.attributes[semconv.OPENINFERENCE_OUTPUT_VALUE])["llm_output"] for s in llm]
    assert [i and i.get("id") for i in ids] == ([None] * 3 if stream else [r.response_id for r in rollout.requests])


async def test_langgraph_garbage_answers_still_give_a_reward(exporter: InMemorySpanExporter) -> None:
    with FakeOpenAI("garbage") as server:
        rollout = await run_rollout(exporter, server, langgraph_agent.write_check_rewrite, {}, "lg-garbage")
    assert rollout.reward == 1.0
    assert len(rollout.requests) == 3
    assert len(llm_spans_openinference(rollout)) == 3


# --- OpenAI Agents SDK --------------------------------------------------------------------------------------


async def test_openai_agents_tool_call_then_answer(exporter: InMemorySpanExporter) -> None:
    with FakeOpenAI("tool_then_text") as server:
        rollout = await run_rollout(exporter, server, openai_agents_agent.add_numbers, {}, "oa")
    assert rollout.reward == 1.0
    assert len(rollout.requests) == 2
    last = rollout.requests[1].body["messages"][-1]
    assert (last["role"], last["content"]) == ("tool", "4")  # the tool ran: 2 + 2
    assert_runner_invariants(rollout)
    llm = llm_spans_openinference(rollout)
    assert [s.name for s in llm] == ["generation", "generation"]
    agent_spans = rollout.where(**{semconv.OPENINFERENCE_AGENT_NAME: openai_agents_agent.AGENT_NAME})
    assert len(agent_spans) == 1
    assert agent_spans[0].attributes[semconv.OPENINFERENCE_GRAPH_NODE_ID] == openai_agents_agent.AGENT_NAME
    for span in llm:
        assert span.attributes[semconv.OPENINFERENCE_LLM_MODEL_NAME] == MODEL
        turn, agent, *_ = rollout.ancestors(span)
        assert (turn.name, agent) == ("turn", agent_spans[0])
    (tool,) = rollout.where(**{"tool.name": "add"})  # openinference's key; nothing in Fulmen reads it (yet)
    assert tool.attributes[semconv.OPENINFERENCE_SPAN_KIND] == "TOOL"
    assert tool.attributes[semconv.OPENINFERENCE_OUTPUT_VALUE] == 4  # the tool's return value, typed: not a string
    assert rollout.parent(tool).name == "turn"


async def test_openai_agents_traces_go_only_to_opentelemetry() -> None:
    """The SDK's default exporter (to OpenAI's servers) is replaced, however often the agent instruments."""
    from agents.tracing import get_trace_provider
    from openinference.instrumentation.openai_agents._processor import OpenInferenceTracingProcessor

    openai_agents_agent.instrument_once()
    openai_agents_agent.instrument_once()
    processors = get_trace_provider()._multi_processor._processors
    assert [type(p) for p in processors] == [OpenInferenceTracingProcessor]


@pytest.mark.parametrize(("script", "calls"), [("garbage", 1), ("bad_arguments", openai_agents_agent.MAX_TURNS)])
async def test_openai_agents_gives_up_on_garbage_within_max_turns(
    exporter: InMemorySpanExporter, script: str, calls: int
) -> None:
    with FakeOpenAI(script) as server:
        rollout = await run_rollout(exporter, server, openai_agents_agent.add_numbers, {}, f"oa-{script}")
    assert rollout.reward == 0.0
    assert len(rollout.requests) == calls
    assert len(llm_spans_openinference(rollout)) == calls
    assert_runner_invariants(rollout)


# --- AutoGen AgentChat --------------------------------------------------------------------------------------


def autogen_agent_span(rollout: Rollout) -> ReadableSpan:
    (span,) = rollout.where(**{semconv.GEN_AI_OPERATION_NAME: semconv.OPERATION_INVOKE_AGENT})
    return span


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_autogen_agent_and_tool_spans(exporter: InMemorySpanExporter, stream: bool) -> None:
    with FakeOpenAI("tool_then_text") as server:
        rollout = await run_rollout(exporter, server, autogen_agent.multiply_numbers, {"stream": stream}, "ag")
    assert rollout.reward == 1.0
    assert [r.body.get("stream", False) for r in rollout.requests] == [stream] * 2
    assert rollout.requests[1].body["messages"][-1]["content"] == "4"  # the tool ran: 2 * 2
    assert_runner_invariants(rollout)
    invoke = autogen_agent_span(rollout)
    assert invoke.name == f"invoke_agent {autogen_agent.AGENT_NAME}"
    assert invoke.attributes[semconv.GEN_AI_AGENT_NAME] == autogen_agent.AGENT_NAME
    assert rollout.parent(invoke) is rollout.root
    (tool,) = rollout.where(**{semconv.GEN_AI_OPERATION_NAME: semconv.OPERATION_EXECUTE_TOOL})
    assert (tool.name, rollout.parent(tool)) == ("execute_tool multiply", invoke)
    (create,) = rollout.where(**{semconv.GEN_AI_OPERATION_NAME: "create_agent"})
    assert rollout.parent(create) is rollout.root


@pytest.mark.skipif(not OPENAI_V2, reason=OPENAI_V2_MISSING)
async def test_autogen_llm_spans_from_the_openai_client_instrumentation(exporter: InMemorySpanExporter) -> None:
    with FakeOpenAI("tool_then_text") as server:
        rollout = await run_rollout(exporter, server, autogen_agent.multiply_numbers, {}, "ag-llm")
    chats = rollout.where(**{semconv.GEN_AI_OPERATION_NAME: semconv.OPERATION_CHAT})
    assert [s.name for s in chats] == [f"chat {MODEL}"] * 2
    assert [rollout.parent(s) for s in chats] == [autogen_agent_span(rollout)] * 2
    assert [s.attributes[semconv.GEN_AI_RESPONSE_ID] for s in chats] == [r.response_id for r in rollout.requests]
    assert all(s.kind is trace.SpanKind.CLIENT for s in chats)


@pytest.mark.parametrize("script", ["garbage", "bad_arguments"])
async def test_autogen_garbage_answers_are_bounded(exporter: InMemorySpanExporter, script: str) -> None:
    with FakeOpenAI(script) as server:
        rollout = await run_rollout(exporter, server, autogen_agent.multiply_numbers, {}, f"ag-{script}")
    assert rollout.reward == 1.0  # the reflection answers noise text, which is non-empty
    assert len(rollout.requests) == 2
    assert rollout.where(**{semconv.GEN_AI_OPERATION_NAME: semconv.OPERATION_EXECUTE_TOOL}) == []
    assert_runner_invariants(rollout)


# --- all three ----------------------------------------------------------------------------------------------

AGENTS = {
    "langgraph": langgraph_agent.write_check_rewrite,
    "openai_agents": openai_agents_agent.add_numbers,
    "autogen": autogen_agent.multiply_numbers,
}


@pytest.mark.parametrize("framework", sorted(AGENTS))
async def test_concurrent_rollouts_keep_their_own_spans(exporter: InMemorySpanExporter, framework: str) -> None:
    """Two rollouts at once in one process (as a runner runs them): no span lands in the other's trace."""
    with FakeOpenAI("tool_then_text") as server:
        first, second = await asyncio.gather(
            *(run_rollout(exporter, server, AGENTS[framework], {}, f"{framework}-{n}") for n in (1, 2))
        )
    for rollout in (first, second):
        assert rollout.reward == 1.0
        assert len(rollout.spans) > 1
        assert_runner_invariants(rollout)
