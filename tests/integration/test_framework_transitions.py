"""Real agent frameworks through the whole path: runner -> LLM gateway -> spans -> transitions.

Each agent (LangGraph, OpenAI Agents SDK, AutoGen AgentChat; ``tests/agents/frameworks``) runs in a runner
process with its framework's own OpenTelemetry instrumentation exported by OTLP; the LLM gateway serves the
tiny model and records each call. The transitions consumer selects the calls of the chosen agents and must
produce one transition per such call, in order, with the token ids the gateway served and the reward the
credit strategy gives.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fulmen.algorithm.service.groups import ClosedGroup, credit_groups
from fulmen.consumers.transitions import TransitionsSection
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store
from fulmen.schemas import semconv
from fulmen.testing.llm_pipeline import llm_gateway_running, published_spans
from tests.integration.span_pipeline import gateway_running
from tests.integration.test_runner import request, submit
from tests.integration.transition_pipeline import BatchReader, consumers_running

pytestmark = [pytest.mark.integration, pytest.mark.frameworks]

FULMEN = [sys.executable, "-m", "fulmen.cli.main"]

# agent, its input, the agent-name pattern selecting calls, LLM calls per rollout of the selected agents
# (None: all of the rollout's calls), and the credit strategy.
CASES = {
    "langgraph": ("langgraph_agent:write_check_rewrite", {"topic": "rivers"}, "write|rewrite", 2, "broadcast"),
    "openai_agents": (
        "openai_agents_agent:add_numbers",
        {"question": "What is 2 + 3?"},
        "calculator",
        None,
        "discounted",
    ),
    "autogen": ("autogen_agent:multiply_numbers", {"question": "What is 3 times 4?"}, "multiplier", None, "broadcast"),
}


def spawn_runner(settings: FulmenSettings, agent: str, llm_port: int, otlp_port: int, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {
        "FULMEN_KAFKA_BOOTSTRAP": settings.bootstrap,
        "FULMEN_KAFKA_TOPIC_PREFIX": settings.kafka.topic_prefix,
        "FULMEN_HOME": str(settings.home),
        "FULMEN_RUNNER_LLM_BASE_URL": f"http://127.0.0.1:{llm_port}",
        "FULMEN_RUNNER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}/v1/traces",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    with open(log, "ab") as out:
        return subprocess.Popen(
            [*FULMEN, "runner", "--agent", f"tests.agents.frameworks.{agent}", "--concurrency", "2"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[2],
        )  # not tests/: its agents/ would shadow the SDK


@pytest.mark.parametrize("framework", sorted(CASES))
async def test_framework_agents_become_transitions_of_the_selected_calls(
    settings: FulmenSettings, linked_store: Store, tiny_model: Path, tmp_path: Path, framework: str
) -> None:
    agent, task, pattern, selected_calls, credit = CASES[framework]
    section = TransitionsSection(agent_pattern=pattern, late_window_s=0)
    rollouts = [f"{framework}-1", f"{framework}-2"]
    log = tmp_path / "runner.log"
    async with (
        consumers_running(settings, linked_store, section),
        gateway_running(settings) as otlp,
        llm_gateway_running(settings, tiny_model, default_max_tokens=24) as llm,
        BatchReader(settings) as reader,
    ):
        runner = spawn_runner(settings, agent, llm.port, otlp.port, log)
        try:
            await submit(settings, [request(r, task) for r in rollouts])
            batches = await reader.until(len(rollouts), timeout_s=180)
        finally:
            runner.send_signal(signal.SIGTERM)
            await asyncio.to_thread(runner.wait, 60)
        served = await published_spans(settings, llm.stats.spans)  # the agents' spans are on the topic too
    assert sorted(b.rollout_id for b in batches) == rollouts, log.read_text()[-3000:]
    for batch in batches:
        calls = sorted(
            (
                s
                for s in served
                if s["attributes"].get(semconv.ROLLOUT_ID) == batch.rollout_id
                and semconv.PROMPT_TOKEN_IDS in s["attributes"]
            ),
            key=lambda s: s["start_ns"],
        )
        by_span = {s["span_id"]: s["attributes"] for s in calls}
        transitions = batch.transitions
        expected = selected_calls if selected_calls is not None else len(calls)
        assert len(transitions) == expected > 0, span_tree(linked_store, batch.rollout_id)
        assert all(pattern_matches(pattern, t.agent_name) for t in transitions)
        # In episode order, each one a call the gateway served, with exactly its token ids.
        order = [s["span_id"] for s in calls]
        assert [order.index(t.span_id) for t in transitions] == sorted(order.index(t.span_id) for t in transitions)
        for t in transitions:
            assert t.prompt_token_ids == by_span[t.span_id][semconv.PROMPT_TOKEN_IDS]
            assert t.response_token_ids == by_span[t.span_id][semconv.RESPONSE_TOKEN_IDS]
        # the run that trains credits what the consumer observed, with its own strategy
        (group,) = credit_groups([ClosedGroup(batch.group_id, batch.task_id, batch.mode, 1, (batch,))], credit, 0.5)
        assert [t.reward for t in group.rollouts[0].transitions] == credited(
            credit, batch.episode_reward, len(transitions)
        )
    if framework == "langgraph":
        assert {tuple(t.agent_name for t in b.transitions) for b in batches} == {("write", "rewrite")}


def span_tree(store: Store, rollout: str) -> str:
    rows = store.query(
        f"SELECT toUnixTimestamp64Milli(Timestamp) % 100000, intDiv(Duration, 1000000), SpanName, SpanKind, SpanId, "
        f"ParentSpanId, AgentName, length(ResponseTokenIds) FROM {store.database}.otel_traces "
        f"WHERE RolloutId = '{rollout}' ORDER BY Timestamp"
    ).rows
    return "\n".join(" ".join(str(v) for v in row) for row in rows)


def pattern_matches(pattern: str, name: str) -> bool:
    import re

    return re.fullmatch(pattern, name) is not None


def credited(strategy: str, episode: float | None, count: int) -> list[float | None]:
    """Hand-computed: broadcast gives every call the episode reward; discounted gives gamma^(T-1-t) of it."""
    if episode is None:
        return [None] * count
    if strategy == "broadcast":
        return [episode] * count
    return [episode * 0.5 ** (count - 1 - t) for t in range(count)]
