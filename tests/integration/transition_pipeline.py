"""The transitions consumer in a test: spans encoded as OTLP protobuf and produced to the spans topic (as the
OTLP and LLM gateways publish them), rollout events published, TransitionBatches read back from Kafka."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from fulmen.consumers import ConsumerOptions, ConsumersApp, SpanSink
from fulmen.consumers.transitions import TransitionBuilderSink, TransitionsSection, TransitionWorker
from fulmen.consumers.transitions.feed import SpanFeed
from fulmen.infra.kafka.clients import consumer, start_or_raise
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store
from fulmen.schemas import semconv
from fulmen.schemas.codec import decode
from fulmen.schemas.events import RolloutEvent, RolloutStatus, TransitionBatch
from fulmen.schemas.topics import TopicKey, topic, topic_name


@dataclass
class FakeSpan:
    """A span as an agent, the runner or the LLM gateway would export it. ``trace`` and ``name`` make its ids."""

    name: str
    rollout: str
    attempt: int = 1
    trace: str = "main"
    parent: str | None = None
    start_ms: int = 0
    end_ms: int = 1
    attributes: dict[str, Any] = field(default_factory=dict)

    def ids(self) -> tuple[bytes, bytes, bytes]:
        trace_id = _digest(f"{self.rollout}/{self.trace}", 16)
        parent = _digest(f"{self.rollout}/{self.attempt}/{self.parent}", 8) if self.parent else b""
        return trace_id, _digest(f"{self.rollout}/{self.attempt}/{self.name}", 8), parent

    @property
    def span_id(self) -> str:
        return self.ids()[1].hex()


def _digest(text: str, size: int) -> bytes:
    import hashlib

    return hashlib.blake2b(text.encode(), digest_size=size).digest()


def llm_call(name: str, rollout: str, start_ms: int, **fields: Any) -> FakeSpan:
    """An LLM gateway span: token ids derived from the start, so each call is recognisable."""
    attributes = {
        semconv.GEN_AI_OPERATION_NAME: semconv.OPERATION_CHAT,
        semconv.GEN_AI_REQUEST_MODEL: "tiny",
        semconv.PROMPT_TOKEN_IDS: [start_ms, start_ms + 1, 7],
        semconv.RESPONSE_TOKEN_IDS: [start_ms + 2, 9],
        semconv.RESPONSE_LOGPROBS: [-0.5, -0.25],
        semconv.MODEL_VERSION: 2,
        **fields.pop("attributes", {}),
    }
    return FakeSpan(name, rollout, start_ms=start_ms, end_ms=start_ms + 5, attributes=attributes, **fields)


def any_value(value: Any) -> AnyValue:
    """An attribute value as an OTLP ``AnyValue`` message (lists and tuples as arrays)."""
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, (list, tuple)):
        array = AnyValue()
        array.array_value.values.extend(any_value(v) for v in value)
        return array
    return AnyValue(string_value=str(value))


def encode(spans: Sequence[FakeSpan], base_ns: int) -> bytes:
    """One ExportTraceServiceRequest; every span carries its rollout id and attempt."""
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for fake in spans:
        span = scope.spans.add()
        span.trace_id, span.span_id, span.parent_span_id = fake.ids()
        span.name = fake.name
        span.kind = Span.SPAN_KIND_SERVER if semconv.PROMPT_TOKEN_IDS in fake.attributes else Span.SPAN_KIND_INTERNAL
        span.start_time_unix_nano = base_ns + fake.start_ms * 1_000_000
        span.end_time_unix_nano = base_ns + fake.end_ms * 1_000_000
        attributes = {semconv.ROLLOUT_ID: fake.rollout, semconv.ROLLOUT_ATTEMPT: fake.attempt, **fake.attributes}
        span.attributes.extend(KeyValue(key=k, value=any_value(v)) for k, v in attributes.items())
    return request.SerializeToString()


BASE_NS = time.time_ns() - 60_000_000_000
"""Time 0 of the fake spans (``start_ms`` counts from it)."""


async def produce_spans(
    producer: AIOKafkaProducer, settings: FulmenSettings, spans: Sequence[FakeSpan], partition: int | None = None
) -> None:
    """Produce spans grouped by trace, keyed by trace id (as the gateways do), acknowledged."""
    base_ns = BASE_NS
    name = topic_name(TopicKey.SPANS, settings.kafka.topic_prefix)
    by_trace: dict[bytes, list[FakeSpan]] = {}
    for fake in spans:
        by_trace.setdefault(fake.ids()[0], []).append(fake)
    for trace_id, group in by_trace.items():
        await producer.send_and_wait(name, encode(group, base_ns), key=trace_id.hex().encode(), partition=partition)


def ended(
    rollout: str,
    status: RolloutStatus = RolloutStatus.SUCCEEDED,
    *,
    attempt: int = 1,
    reward: float | None = 1.0,
    group: str = "g1",
) -> RolloutEvent:
    error = None if status in (RolloutStatus.SUCCEEDED, RolloutStatus.CLAIMED, RolloutStatus.RUNNING) else "boom"
    return RolloutEvent(
        rollout_id=rollout,
        attempt=attempt,
        status=status,
        task_id=f"task-{rollout}",
        group_id=group,
        reward=reward if status is RolloutStatus.SUCCEEDED else None,
        error=error,
    )


def builders(app: ConsumersApp) -> list[TransitionWorker]:
    return [w for w in app.workers if isinstance(w, TransitionWorker)]


@asynccontextmanager
async def consumers_running(
    settings: FulmenSettings,
    store: Store,
    section: TransitionsSection,
    *,
    spans: bool = True,
    builder: bool = True,
    feed: SpanFeed | None = None,
) -> AsyncIterator[ConsumersApp]:
    """A consumers process with the spans sink and/or the transition builder, in this event loop; with both, the
    span feed joins them as in ``fulmen consume`` (``feed``, or one of the section's size) unless the section
    turns it off."""
    if feed is None and spans and builder and section.from_stream:
        feed = SpanFeed(section.feed_max_mb * 1024**2)
    sinks: list[Any] = ([SpanSink(feed=feed)] if spans else []) + (
        [TransitionBuilderSink(section, feed)] if builder else []
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    app = ConsumersApp(settings, store, sinks, ConsumerOptions(max_wait_s=0.1))
    task = asyncio.create_task(app.run(stop, ready))
    await asyncio.wait_for(ready.wait(), 60)
    try:
        yield app
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


class BatchReader:
    """Reads TransitionBatches from the transitions topic, from its beginning (no consumer group)."""

    def __init__(self, settings: FulmenSettings) -> None:
        self.settings = settings
        self.consumer = consumer(settings, None)
        self.batches: list[TransitionBatch] = []
        self.keys: list[bytes] = []

    async def __aenter__(self) -> BatchReader:
        await start_or_raise(self.consumer, self.settings)
        name = topic_name(TopicKey.TRANSITIONS, self.settings.kafka.topic_prefix)
        partitions = [TopicPartition(name, p) for p in range(topic(TopicKey.TRANSITIONS).partitions)]
        self.consumer.assign(partitions)
        await self.consumer.seek_to_beginning(*partitions)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.consumer.stop()

    async def until(self, count: int, timeout_s: float = 60) -> list[TransitionBatch]:
        """Read until ``count`` batches in all have arrived (or time is up); all read so far."""
        deadline = time.monotonic() + timeout_s
        while len(self.batches) < count and time.monotonic() < deadline:
            for records in (await self.consumer.getmany(timeout_ms=200)).values():
                for record in records:
                    self.batches.append(decode(TransitionBatch, record.value))
                    self.keys.append(record.key)
        return self.batches
