"""``fulmen smoke``: a fast end-to-end check of the plumbing, without a model (``fulmen demo`` is the training run).

It publishes one event of each kind to the real broker, sends a small trace through the OTLP gateway with
the stock OpenTelemetry exporter (as an agent would), lets the real consumers materialise everything into
the store, reads it back with SQL, and shows a poison record going to the dead-letter topic while the stream
goes on. Every id carries one run id, so runs never mix.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from aiokafka import TopicPartition

from fulmen.consumers import ConsumerOptions, ConsumersApp, default_sinks
from fulmen.infra.kafka.broker import kafka_broker
from fulmen.infra.kafka.clients import close_quietly, consumer, start_or_raise
from fulmen.infra.kafka.publish import ANY_SENDER, EventPublisher, Sender
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import QueryResult, Store
from fulmen.producers.otlp_gateway import OtlpGateway, OtlpGatewaySettings
from fulmen.schemas import semconv
from fulmen.schemas.codec import decode
from fulmen.schemas.events import (
    DeadLetterHeaders,
    ModelVersion,
    RolloutEvent,
    RolloutRequest,
    RolloutStatus,
    TrainStep,
    Transition,
    TransitionBatch,
    new_id,
)
from fulmen.schemas.topics import TopicKey, topic, topic_name

__all__ = ["SmokeReport", "run_smoke"]

SENDER = Sender("smoke", ANY_SENDER.topics)  # one event of each kind


@dataclass
class SmokeReport:
    run_id: str
    published: dict[str, int] = field(default_factory=dict)
    queries: list[tuple[str, str, QueryResult]] = field(default_factory=list)
    task_read_back: bool = False
    dead_letter: DeadLetterHeaders | None = None
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "published": self.published,
            "rows": {title: len(result.rows) for title, _, result in self.queries},
            "task_read_back": self.task_read_back,
            "dead_lettered": self.dead_letter is not None,
            "wall_s": round(self.wall_s, 2),
        }


def _events(run_id: str) -> dict[TopicKey, list[Any]]:
    group = f"{run_id}-g"
    request = RolloutRequest(
        rollout_id=f"{run_id}-r1", task_id=f"{run_id}-t1", group_id=group, input={"question": "What is 2 + 3?"}
    )
    common = {"rollout_id": request.rollout_id, "attempt": 1, "task_id": request.task_id, "group_id": group}
    lifecycle = [
        RolloutEvent(**common, status=RolloutStatus.CLAIMED, runner_id="smoke"),
        RolloutEvent(**common, status=RolloutStatus.RUNNING, runner_id="smoke"),
        RolloutEvent(**common, status=RolloutStatus.SUCCEEDED, runner_id="smoke", reward=1.0, model_version=0),
    ]
    calls = [
        Transition(
            rollout_id=request.rollout_id,
            attempt=1,
            index=i,
            trace_id="ab" * 16,
            span_id=f"{i + 1:016x}",
            agent_name=agent,
            model_version=0,
            prompt_token_ids=prompt,
            response_token_ids=response,
            response_logprobs=[-0.1] * len(response),
        )
        for i, (agent, prompt, response) in enumerate(
            [("planner", [1, 2, 3], [4, 5]), ("solver", [1, 2, 3, 4, 5, 6], [7])]
        )
    ]
    batch = TransitionBatch(
        **common, status=RolloutStatus.SUCCEEDED, episode_reward=1.0, model_version=0, transitions=calls
    )
    model = ModelVersion(
        model_name=f"{run_id}-model", version=1, uri="/tmp/fulmen-smoke/model-v1", run_id=run_id, step=1
    )
    step = TrainStep(
        run_id=run_id,
        step=1,
        model_version=1,
        num_transitions=2,
        num_groups=1,
        reward_mean=1.0,
        reward_std=0.0,
        loss=0.0,
    )
    return {
        TopicKey.TASKS: [request],
        TopicKey.ROLLOUTS: lifecycle,
        TopicKey.TRANSITIONS: [batch],
        TopicKey.MODELS: [model],
        TopicKey.METRICS: [step],
    }


def _send_trace(url: str, run_id: str) -> None:
    """What an instrumented agent does: the OpenTelemetry SDK and its OTLP/HTTP exporter, nothing of ours."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({semconv.SERVICE_NAME: "smoke-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=url, timeout=30)))
    tracer = provider.get_tracer("fulmen.smoke")
    rollout = {semconv.ROLLOUT_ID: f"{run_id}-r1", semconv.ROLLOUT_ATTEMPT: 1}
    with (
        tracer.start_as_current_span(
            "invoke_agent solver", attributes={**rollout, semconv.GEN_AI_AGENT_NAME: "solver"}
        ),
        tracer.start_as_current_span(
            "chat tiny",
            attributes={
                **rollout,
                semconv.GEN_AI_OPERATION_NAME: "chat",
                semconv.PROMPT_TOKEN_IDS: (1, 2, 3),
                semconv.RESPONSE_TOKEN_IDS: (4, 5),
            },
        ),
    ):
        pass
    provider.shutdown()


def _queries(store: Store, run_id: str) -> list[tuple[str, str]]:
    db = store.database
    return [
        (
            "spans",
            f"SELECT SpanName, ServiceName, AgentName, PromptTokenIds, ResponseTokenIds, Duration "
            f"FROM {db}.otel_traces WHERE RolloutId = '{run_id}-r1' ORDER BY Timestamp",
        ),
        ("rollouts", f"SELECT RolloutId, Attempt, Status, Reward FROM {db}.rollouts WHERE RolloutId LIKE '{run_id}%'"),
        (
            "transitions",
            f"SELECT RolloutId, CallIndex, AgentName, PromptTokenIds, ResponseTokenIds, EpisodeReward "
            f"FROM {db}.transitions WHERE RolloutId LIKE '{run_id}%' ORDER BY CallIndex",
        ),
        ("model_versions", f"SELECT ModelName, Version, Uri FROM {db}.model_versions WHERE RunId = '{run_id}'"),
        ("train_steps", f"SELECT RunId, Step, ModelVersion, RewardMean FROM {db}.train_steps WHERE RunId = '{run_id}'"),
    ]


async def run_smoke(settings: FulmenSettings, store: Store, timeout_s: float = 60.0) -> SmokeReport:
    started = time.monotonic()
    run_id = f"smoke-{new_id()[:12]}"
    report = SmokeReport(run_id)
    stop, ready = asyncio.Event(), asyncio.Event()
    app = ConsumersApp(settings, store, default_sinks(), ConsumerOptions(max_wait_s=0.2, serve_reads=False))
    consuming = asyncio.create_task(app.run(stop, ready))
    broker = kafka_broker(settings)
    gateway = OtlpGateway(OtlpGatewaySettings(**settings.model_dump(), otlp={"port": 0}))
    await start_or_raise(broker, settings, "smoke publisher")
    try:
        await gateway.start()
        await asyncio.wait_for(ready.wait(), timeout_s)
        await asyncio.wait_for(gateway.connected.wait(), timeout_s)
        await asyncio.to_thread(_send_trace, f"http://127.0.0.1:{gateway.port}/v1/traces", run_id)
        report.published["spans (OTLP)"] = 2
        publisher = EventPublisher(broker, SENDER)
        task_meta = None
        for key, events in _events(run_id).items():
            metas = await publisher.publish_many(key, events)
            report.published[key.value] = len(metas)
            task_meta = metas[0] if key is TopicKey.TASKS else task_meta
        poison = await broker.publisher(topic(TopicKey.ROLLOUTS).name, include_in_schema=False).publish(
            b'{"not": "an event"}', key=run_id.encode()
        )
        report.published["poison (rollouts)"] = 1
        report.queries = await _wait_for_rows(store, run_id, started + timeout_s)
        report.task_read_back = await _read_task_back(settings, task_meta, run_id)
        report.dead_letter = await _find_dead_letter(settings, poison.partition, poison.offset)
    finally:
        stop.set()
        await gateway.stop()
        await close_quietly([broker])
        await consuming
    report.wall_s = time.monotonic() - started
    return report


async def _wait_for_rows(store: Store, run_id: str, deadline: float) -> list[tuple[str, str, QueryResult]]:
    wanted = {"spans": 2, "rollouts": 1, "transitions": 2, "model_versions": 1, "train_steps": 1}
    while True:
        results = [(title, sql, await asyncio.to_thread(store.query, sql)) for title, sql in _queries(store, run_id)]
        done = all(len(r.rows) >= wanted[t] for t, _, r in results)
        rollouts = dict((t, r) for t, _, r in results)["rollouts"]
        rollout_done = rollouts.rows and rollouts.rows[0][2] == RolloutStatus.SUCCEEDED.value
        if (done and rollout_done) or time.monotonic() > deadline:
            return results
        await asyncio.sleep(0.2)


async def _read_task_back(settings: FulmenSettings, meta: Any, run_id: str) -> bool:
    reader = consumer(settings, None)
    await start_or_raise(reader, settings, "smoke task reader")
    try:
        tp = TopicPartition(meta.topic, meta.partition)
        reader.assign([tp])
        reader.seek(tp, meta.offset)
        batch = await reader.getmany(tp, timeout_ms=10_000, max_records=1)
        records = batch.get(tp, [])
        return bool(records) and decode(RolloutRequest, records[0].value).rollout_id == f"{run_id}-r1"
    finally:
        await reader.stop()


async def _find_dead_letter(settings: FulmenSettings, partition: int, offset: int) -> DeadLetterHeaders | None:
    reader = consumer(settings, None)
    await start_or_raise(reader, settings, "smoke dead-letter reader")
    dlq = topic_name(TopicKey.DLQ, settings.kafka.topic_prefix)
    try:
        await reader.topics()  # load metadata, so the partitions of the dead-letter topic are known
        partitions = [TopicPartition(dlq, p) for p in sorted(reader.partitions_for_topic(dlq) or {0})]
        reader.assign(partitions)
        await reader.seek_to_beginning(*partitions)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for records in (await reader.getmany(timeout_ms=500)).values():
                for record in records:
                    headers = DeadLetterHeaders.from_kafka(record.headers)
                    source = (headers.source_topic, headers.source_partition, headers.source_offset)
                    if source == (topic_name(TopicKey.ROLLOUTS, settings.kafka.topic_prefix), partition, offset):
                        return headers
        return None
    finally:
        await reader.stop()
