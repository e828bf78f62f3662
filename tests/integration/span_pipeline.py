"""A running span pipeline for tests: the OTLP gateway and the spans consumer in the test's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fulmen.consumers import ConsumerOptions, ConsumersApp, EventSink, Sink, SpanSink
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store
from fulmen.producers.otlp_gateway import OtlpGateway, OtlpGatewaySettings
from tests.polling import count_reaches


@dataclass
class Pipeline:
    gateway: OtlpGateway
    store: Store

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}/v1/traces"

    async def wait_spans(self, where: str, expected: int, timeout_s: float = 30) -> int:
        sql = f"SELECT count() FROM {self.store.database}.otel_traces WHERE {where}"
        return await count_reaches(self.store, sql, expected, timeout_s)


def gateway_settings(settings: FulmenSettings, **otlp: object) -> OtlpGatewaySettings:
    return OtlpGatewaySettings(
        home=settings.home,
        kafka=settings.kafka.model_dump(),
        clickhouse=settings.clickhouse.model_dump(),
        otlp={"port": 0, **otlp},
    )


@asynccontextmanager
async def gateway_running(settings: FulmenSettings, **otlp: object) -> AsyncIterator[OtlpGateway]:
    gateway = OtlpGateway(gateway_settings(settings, **otlp))
    await gateway.start()
    await asyncio.wait_for(gateway.connected.wait(), 30)
    try:
        yield gateway
    finally:
        await gateway.stop()


@asynccontextmanager
async def span_pipeline(
    settings: FulmenSettings, store: Store, *, sinks: Sequence[Sink | EventSink] | None = None, **otlp: object
) -> AsyncIterator[Pipeline]:
    """The gateway and the consumers of ``sinks`` (the spans sink alone by default)."""
    stop, ready = asyncio.Event(), asyncio.Event()
    app = ConsumersApp(settings, store, list(sinks or [SpanSink()]), ConsumerOptions(max_wait_s=0.1))
    consuming = asyncio.create_task(app.run(stop, ready))
    await asyncio.wait_for(ready.wait(), 60)
    try:
        async with gateway_running(settings, **otlp) as gateway:
            yield Pipeline(gateway, store)
    finally:
        stop.set()
        await asyncio.wait_for(consuming, 60)
