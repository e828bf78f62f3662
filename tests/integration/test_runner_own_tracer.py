"""Issue 11: an agent with its own tracer provider, run by a real ``fulmen runner`` exporting to a real OTLP
gateway, puts each span on the spans topic once, stamped with its rollout (set up at import or late)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from fulmen.infra.kafka.admin import partition_count
from fulmen.infra.kafka.clients import close_quietly, consumer, start_or_raise
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas import TopicKey, semconv, topic_name
from fulmen.testing.llm_pipeline import attribute_value
from tests.integration.span_pipeline import gateway_running
from tests.integration.test_runner import request, submit, wait_terminal

pytestmark = [pytest.mark.integration, pytest.mark.security]

ROOT = Path(__file__).resolve().parents[2]
SPANS_PER_ROLLOUT = 3  # the agents' SPANS_PER_ROLLOUT


def spawn_runner(settings: FulmenSettings, agent: str, otlp_endpoint: str, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FULMEN_", "OTEL_"))} | {
        "FULMEN_KAFKA_BOOTSTRAP": settings.bootstrap,
        "FULMEN_KAFKA_TOPIC_PREFIX": settings.kafka.topic_prefix,
        "FULMEN_HOME": str(settings.home),
        "FULMEN_RUNNER_OTLP_ENDPOINT": otlp_endpoint,
        "PYTHONPATH": str(ROOT),
    }
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "fulmen.cli.main", "runner", "--agent", agent, "--concurrency", "2"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def spans_on_topic(settings: FulmenSettings) -> list[dict[str, Any]]:
    """Every span on the spans topic up to its end now, one dict per span (a copy is a second dict)."""
    topic = topic_name(TopicKey.SPANS, settings.kafka.topic_prefix)
    reader = consumer(settings, None)
    await start_or_raise(reader, settings, "test span reader")
    spans: list[dict[str, Any]] = []
    try:
        partitions = [TopicPartition(topic, p) for p in range(await partition_count(settings, topic))]
        reader.assign(partitions)
        await reader.seek_to_beginning(*partitions)
        ends = await reader.end_offsets(partitions)
        while [tp for tp, end in ends.items() if await reader.position(tp) < end]:
            for records in (await reader.getmany(timeout_ms=200)).values():
                for record in records:
                    for resource_spans in ExportTraceServiceRequest.FromString(record.value).resource_spans:
                        for scope_spans in resource_spans.scope_spans:
                            spans.extend(
                                {
                                    "name": span.name,
                                    "trace_id": span.trace_id.hex(),
                                    "span_id": span.span_id.hex(),
                                    "attributes": {kv.key: attribute_value(kv.value) for kv in span.attributes},
                                }
                                for span in scope_spans.spans
                            )
    finally:
        await close_quietly([reader])
    return spans


@pytest.mark.parametrize("setup", ["import", "late"])
async def test_an_agents_own_provider_puts_each_span_on_the_topic_once_and_stamped(
    settings: FulmenSettings, tmp_path: Path, setup: str
) -> None:
    rollouts = {f"{setup}-{i}" for i in range(4)}
    log = tmp_path / "runner.log"
    async with gateway_running(settings) as gateway:
        runner = spawn_runner(
            settings, f"tests.agents.own_tracer_{setup}:run", f"http://localhost:{gateway.port}/v1/traces", log
        )
        try:
            await submit(settings, [request(r, {}) for r in sorted(rollouts)])
            events = await wait_terminal(settings, rollouts, timeout_s=120)
            # the runner flushes every provider that exports to it before it reports a rollout's end
            at_the_end = await spans_on_topic(settings)
        finally:
            runner.send_signal(signal.SIGTERM)
            exit_code = await asyncio.to_thread(runner.wait, 60)
        # Every exporter of the runner's process, a second one included, flushed when it exited (each SDK
        # provider shuts down at exit), and the gateway answers once Kafka has the spans: all are on the topic.
        spans = await spans_on_topic(settings)
    assert exit_code == 0, log.read_text()[-3000:]
    assert {r for r in rollouts if events[r][-1].status == "succeeded"} == rollouts, log.read_text()[-3000:]
    copies = Counter(span["span_id"] for span in spans)
    assert len(spans) == len(rollouts) * (SPANS_PER_ROLLOUT + 1), (Counter(s["name"] for s in spans), log.read_text())
    assert max(copies.values()) == 1  # no span was exported twice
    assert len(at_the_end) == len(spans)  # none came after its rollout's end was reported
    roots = {span["attributes"][semconv.ROLLOUT_ID]: span for span in spans if span["name"] == semconv.SPAN_ROLLOUT}
    assert set(roots) == rollouts
    agent_spans = [span for span in spans if span["name"] != semconv.SPAN_ROLLOUT]
    assert Counter(span["attributes"].get(semconv.ROLLOUT_ID) for span in agent_spans) == {
        r: SPANS_PER_ROLLOUT for r in rollouts
    }
    for span in agent_spans:  # and nested in its rollout's trace
        rollout = span["attributes"][semconv.ROLLOUT_ID]
        assert span["trace_id"] == roots[rollout]["trace_id"]
        assert span["attributes"][semconv.ROLLOUT_ATTEMPT] == 1
