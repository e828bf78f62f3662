"""The LLM gateway running in the test's event loop, a reader of the spans it publishes to Kafka, and a transport
that records what a llama-server answered."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from aiokafka import TopicPartition
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from fulmen.infra.kafka.admin import partition_count
from fulmen.infra.kafka.clients import close_quietly, consumer, start_or_raise
from fulmen.infra.settings import FulmenSettings
from fulmen.producers.llm_gateway import LlmGateway, LlmGatewaySettings
from fulmen.schemas import TopicKey, topic_name


def llm_settings(settings: FulmenSettings, model: Path | str, **llm: object) -> LlmGatewaySettings:
    return LlmGatewaySettings(
        home=settings.home,
        kafka=settings.kafka.model_dump(),
        clickhouse=settings.clickhouse.model_dump(),
        llm={"model": str(model), "port": 0, "batch_wait_ms": 5, **llm},
    )


@asynccontextmanager
async def llm_gateway_running(settings: FulmenSettings, model: Path | str, **llm: object) -> AsyncIterator[LlmGateway]:
    gateway = LlmGateway(llm_settings(settings, model, **llm))
    await gateway.start()
    try:
        yield gateway
    finally:
        await gateway.stop()


def base_url(gateway: LlmGateway, rollout_id: str | None = None, attempt: int = 1) -> str:
    root = f"http://127.0.0.1:{gateway.port}"
    return f"{root}/rollout/{rollout_id}/attempt/{attempt}/v1" if rollout_id else f"{root}/v1"


def attribute_value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [attribute_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@asynccontextmanager
async def _span_reader(settings: FulmenSettings) -> AsyncIterator[tuple[Any, list[TopicPartition]]]:
    """A consumer assigned to every partition of the spans topic, at the beginning."""
    topic = topic_name(TopicKey.SPANS, settings.kafka.topic_prefix)
    reader = consumer(settings, None)
    await start_or_raise(reader, settings, "test span reader")
    try:
        partitions = [TopicPartition(topic, p) for p in range(await partition_count(settings, topic))]
        reader.assign(partitions)
        await reader.seek_to_beginning(*partitions)
        yield reader, partitions
    finally:
        await close_quietly([reader])


async def _read(reader: Any, spans: list[dict[str, Any]]) -> None:
    for records in (await reader.getmany(timeout_ms=200)).values():
        for record in records:
            spans.extend(_spans(record.key, record.value))


async def published_spans(settings: FulmenSettings, expected: int, timeout_s: float = 30) -> list[dict[str, Any]]:
    """The first ``expected`` spans on the spans topic, each as a dict (name, ids, kind, attributes), in the
    order they started."""
    spans: list[dict[str, Any]] = []
    async with _span_reader(settings) as (reader, _), asyncio.timeout(timeout_s):
        while len(spans) < expected:
            await _read(reader, spans)
    return sorted(spans, key=lambda span: span["start_ns"])  # records of different traces use different partitions


async def all_published_spans(settings: FulmenSettings, timeout_s: float = 30) -> list[dict[str, Any]]:
    """Every span on the spans topic up to its end offsets now, in the order they started (duplicates kept)."""
    spans: list[dict[str, Any]] = []
    async with _span_reader(settings) as (reader, partitions), asyncio.timeout(timeout_s):
        ends = await reader.end_offsets(partitions)
        behind = [tp for tp, end in ends.items() if end > 0]
        while behind:
            await _read(reader, spans)
            behind = [tp for tp in behind if await reader.position(tp) < ends[tp]]
    return sorted(spans, key=lambda span: span["start_ns"])


def _spans(key: bytes, value: bytes) -> list[dict[str, Any]]:
    request = ExportTraceServiceRequest.FromString(value)
    out = []
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(
                    {
                        "key": key.decode(),
                        "name": span.name,
                        "kind": span.kind,
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(),
                        "start_ns": span.start_time_unix_nano,
                        "attributes": {kv.key: attribute_value(kv.value) for kv in span.attributes},
                    }
                )
    return out


class RecordingTransport(httpx.AsyncHTTPTransport):
    """The transport to a llama-server (the llamacpp backend's), keeping every ``/completion`` request and answer."""

    def __init__(self) -> None:
        super().__init__()
        self.exchanges: list[tuple[dict[str, Any], Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path == "/completion":
            content = await response.aread()
            self.exchanges.append((json.loads(request.content), json.loads(content)))
            return httpx.Response(response.status_code, headers=response.headers, content=content)
        return response

    def sampled(self) -> list[list[int]]:
        """The token ids of every completion llama-server returned, in order."""
        return [
            item["tokens"]
            for _, answer in self.exchanges
            for item in (answer if isinstance(answer, list) else [answer])
        ]
