"""The runner's pure parts: agent loading and calling, rollout stamping of spans (offsets: test_kafka_offsets)."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fulmen.producers.runner.agent import AgentError, LLMEndpoint, call_agent, load_agent
from fulmen.producers.runner.tracing import CURRENT_ROLLOUT, RolloutStamper
from fulmen.schemas import RolloutRequest, semconv
from fulmen.schemas.errors import ConfigurationError

LLM = LLMEndpoint(base_url="http://gw/rollout/r/attempt/1/v1", model="m")


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("nocolon", "package.module:function"),
        ("no_such_module_xyz:f", "cannot import"),
        ("tests.agents.simple:missing", "has no 'missing'"),
        ("tests.agents.simple:tracer", "not a function"),
    ],
)
def test_bad_agent_paths_say_what_is_wrong(path: str, words: str) -> None:
    with pytest.raises(ConfigurationError, match=words):
        load_agent(path)


async def test_sync_and_async_agents_and_their_results() -> None:
    assert await call_agent(load_agent("tests.agents.simple:echo_reward"), {"reward": 0.5}, LLM) == 0.5
    assert await call_agent(load_agent("tests.agents.simple:async_echo"), {}, LLM) is None
    with pytest.raises(AgentError, match="ValueError: this agent always fails"):
        await call_agent(load_agent("tests.agents.simple:always_fails"), {}, LLM)
    with pytest.raises(AgentError, match="returned 'not a reward'"):
        await call_agent(load_agent("tests.agents.simple:returns_text"), {}, LLM)


async def test_every_span_of_a_rollout_is_stamped_even_in_a_worker_thread() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(RolloutStamper())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    request = RolloutRequest(rollout_id="r9", attempt=2, max_attempts=3, task_id="t", group_id="g", input={})

    def in_thread() -> None:
        with tracer.start_as_current_span("in a thread"):
            pass

    token = CURRENT_ROLLOUT.set(request)
    try:
        with tracer.start_as_current_span("in the task"):
            await asyncio.to_thread(in_thread)
    finally:
        CURRENT_ROLLOUT.reset(token)
    with tracer.start_as_current_span("outside"):
        pass
    spans = {s.name: s.attributes for s in exporter.get_finished_spans()}
    for name in ("in a thread", "in the task"):
        assert spans[name][semconv.ROLLOUT_ID] == "r9" and spans[name][semconv.ROLLOUT_ATTEMPT] == 2
    assert semconv.ROLLOUT_ID not in spans["outside"]
