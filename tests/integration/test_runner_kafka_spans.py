"""The runner writes its agents' spans straight into the spans topic (``FULMEN_RUNNER_SPAN_EXPORT=kafka``, the
default): no OTLP gateway runs here, and the records are the gateway's (one per trace, keyed by its trace id, an
OTLP protobuf export), every span stamped with its rollout, all of them on the topic once the rollouts ended."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult

from fulmen.infra.kafka.clients import producer
from fulmen.infra.settings import FulmenSettings
from fulmen.producers.runner import Runner, load_agent
from fulmen.producers.runner.kafka_spans import KafkaSpanExporter
from fulmen.schemas import TopicKey, semconv
from tests.integration.test_feedback import records_of
from tests.integration.test_runner import request, runner_settings, submit, wait_terminal

pytestmark = pytest.mark.integration

AGENT = "tests.agents.simple:echo_reward"  # one span of its own a rollout, inside the runner's fulmen.rollout


async def test_spans_reach_the_topic_without_the_otlp_gateway(settings: FulmenSettings) -> None:
    options = runner_settings(settings, AGENT, concurrency=3)
    options.runner.otlp_endpoint = "http://127.0.0.1:9/v1/traces"  # nothing listens there: not needed
    rollouts = {f"k{i}" for i in range(5)}
    await submit(settings, [request(r, {"reward": 1.0}) for r in sorted(rollouts)])
    runner = Runner(options, load_agent(AGENT))  # its own provider, exporting through Kafka
    assert runner.span_exporter is not None
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        events = await wait_terminal(settings, rollouts)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    assert all(any(e.status.value == "succeeded" for e in events[r]) for r in rollouts)
    names: dict[str, set[str]] = defaultdict(set)
    for record in await records_of(settings, TopicKey.SPANS, runner.span_exporter.records):
        key, export = record.key, ExportTraceServiceRequest.FromString(record.value)
        spans = [s for rs in export.resource_spans for ss in rs.scope_spans for s in ss.spans]
        assert {s.trace_id.hex().encode() for s in spans} == {key}  # one trace a record, keyed by it
        for span in spans:
            attributes = {a.key: a.value.string_value for a in span.attributes}
            names[attributes[semconv.ROLLOUT_ID]].add(span.name)
    assert {r: names[r] for r in rollouts} == {r: {semconv.SPAN_ROLLOUT, "think"} for r in rollouts}
    assert runner.span_exporter.spans >= 2 * len(rollouts) and runner.span_exporter.refused == 0


async def test_an_export_with_no_loop_to_send_on_fails_rather_than_blocks(settings: FulmenSettings) -> None:
    exporter = KafkaSpanExporter(producer(settings), "spans", "feedback")
    provider = TracerProvider()
    with provider.get_tracer("t").start_as_current_span("s") as span:
        pass
    assert exporter.export([span]) is SpanExportResult.FAILURE  # not bound to a loop yet
    assert exporter.export([]) is SpanExportResult.SUCCESS


async def test_a_failed_export_is_noted_by_rollout(settings: FulmenSettings) -> None:
    from fulmen.producers.runner.tracing import ExportFailures

    failures = ExportFailures()
    exporter = KafkaSpanExporter(producer(settings), "spans", "feedback", failures=failures)
    provider = TracerProvider()
    with provider.get_tracer("t").start_as_current_span("s", attributes={semconv.ROLLOUT_ID: "r1"}) as span:
        span.set_attribute(semconv.ROLLOUT_ATTEMPT, 2)
    assert exporter.export([span]) is SpanExportResult.FAILURE  # not bound to a loop yet
    assert failures.take("r1", 1) is None
    assert "event loop" in (failures.take("r1", 2) or "")
    assert failures.take("r1", 2) is None  # taken once
