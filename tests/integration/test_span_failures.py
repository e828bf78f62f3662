"""Span capture under bad input and failure: clear statuses, dead letters, kill -9, a broker that goes away."""

from __future__ import annotations

import asyncio
import gzip
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from aiokafka import TopicPartition
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from bench.otlp_payloads import make_request
from fulmen.infra.kafka.admin import ensure_topics
from fulmen.infra.kafka.clients import consumer, producer, start_or_raise
from fulmen.infra.kafka.local import LocalKafka
from fulmen.infra.processes import free_port
from fulmen.infra.settings import BrokerSettings, FulmenSettings
from fulmen.infra.store import RemoteReader, Store
from fulmen.schemas import DeadLetterHeaders, TopicKey, topic, topic_name
from tests.integration.span_pipeline import gateway_running, span_pipeline
from tests.polling import count_reaches

pytestmark = pytest.mark.integration

PROTOBUF = {"Content-Type": "application/x-protobuf"}


async def end_offsets(settings: FulmenSettings, key: TopicKey) -> int:
    reader = consumer(settings, None)
    await start_or_raise(reader, settings)
    try:
        name = topic_name(key, settings.kafka.topic_prefix)
        partitions = [TopicPartition(name, p) for p in range(topic(key).partitions)]
        return sum((await reader.end_offsets(partitions)).values())
    finally:
        await reader.stop()


async def test_bad_requests_get_the_right_status_and_publish_nothing(settings: FulmenSettings) -> None:
    body = make_request(10, seed=1).SerializeToString()
    async with gateway_running(settings, bearer_token="s3cret", max_body_bytes=64 * 1024) as gateway:
        url = f"http://127.0.0.1:{gateway.port}/v1/traces"
        before = await end_offsets(settings, TopicKey.SPANS)
        async with httpx.AsyncClient() as client:
            auth = {"Authorization": "Bearer s3cret"}
            cases = [
                (await client.post(url, content=body, headers=PROTOBUF), 401),
                (await client.post(url, content=body, headers=PROTOBUF | {"Authorization": "Bearer nope"}), 401),
                (await client.post(url, content=body, headers=PROTOBUF | {"Authorization": "Basic czNjcmV0"}), 401),
                (await client.post(url, content=b"\x0a\xff\xff\xff", headers=PROTOBUF | auth), 400),
                (
                    await client.post(url, content=b"{not json", headers={"Content-Type": "application/json"} | auth),
                    400,
                ),
                (
                    await client.post(
                        url,
                        content=b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}',
                        headers={"Content-Type": "application/json"} | auth,
                    ),
                    400,
                ),
                (await client.post(url, content=body, headers={"Content-Type": "text/plain"} | auth), 415),
                (await client.post(url, content=b"x" * (65 * 1024), headers=PROTOBUF | auth), 413),
                (
                    await client.post(
                        url,
                        content=gzip.compress(b"\0" * (1024 * 1024)),
                        headers=PROTOBUF | auth | {"Content-Encoding": "gzip"},
                    ),
                    413,
                ),
            ]
            for response, expected in cases:
                assert response.status_code == expected, (expected, response.text)
            assert "invalid" not in cases[3][0].text and b"not an OTLP" in cases[3][0].content
            assert cases[0][0].headers["WWW-Authenticate"].startswith("Bearer")
            assert b"not hex" in cases[5][0].content
            ok = await client.post(url, content=body, headers=PROTOBUF | auth)
            assert ok.status_code == 200
        assert await end_offsets(settings, TopicKey.SPANS) == before + 1  # only the good request


async def test_spans_with_bad_ids_are_a_partial_success(settings: FulmenSettings) -> None:
    request = make_request(6, seed=2, spans_per_trace=6)
    spans = request.resource_spans[0].scope_spans[0].spans
    spans[1].trace_id = b"\0" * 16
    spans[2].span_id = b"abc"
    async with gateway_running(settings) as gateway, httpx.AsyncClient() as client:
        answer = await client.post(
            f"http://127.0.0.1:{gateway.port}/v1/traces", content=request.SerializeToString(), headers=PROTOBUF
        )
    assert answer.status_code == 200
    response = ExportTraceServiceResponse.FromString(answer.content)
    assert response.partial_success.rejected_spans == 2
    assert "trace_id must be 16 bytes" in response.partial_success.error_message
    assert gateway.stats.spans_accepted == 4


async def test_undecodable_kafka_records_go_to_the_dead_letter_topic(
    settings: FulmenSettings, linked_store: Store
) -> None:
    prefix = settings.kafka.topic_prefix
    spans_topic = topic_name(TopicKey.SPANS, prefix)
    kafka_producer = producer(settings)
    await start_or_raise(kafka_producer, settings)
    try:
        async with span_pipeline(settings, linked_store) as pipeline:
            await kafka_producer.send_and_wait(
                spans_topic, make_request(5, marker="before").SerializeToString(), partition=0
            )
            await kafka_producer.send_and_wait(spans_topic, b"\x0a\x05garbage-not-protobuf", key=b"k", partition=0)
            # A record exactly as an OpenTelemetry Collector's Kafka exporter (otlp_proto) writes it.
            await kafka_producer.send_and_wait(
                spans_topic, make_request(7, marker="after").SerializeToString(), partition=0
            )
            assert await pipeline.wait_spans("SpanAttributes['bench.marker'] = 'after'", 7) == 7
            assert await pipeline.wait_spans("SpanAttributes['bench.marker'] = 'before'", 5) == 5
    finally:
        await kafka_producer.stop()
    reader = consumer(settings, None)
    await start_or_raise(reader, settings)
    try:
        tp = TopicPartition(topic_name(TopicKey.DLQ, prefix), 0)
        reader.assign([tp])
        await reader.seek_to_beginning(tp)
        records = (await reader.getmany(tp, timeout_ms=10_000))[tp]
    finally:
        await reader.stop()
    headers = DeadLetterHeaders.from_kafka(records[0].headers)
    assert records[0].value == b"\x0a\x05garbage-not-protobuf"
    assert (headers.source_topic, headers.source_offset) == (spans_topic, 1)
    assert "not valid OTLP protobuf" in headers.error and headers.error_type == "DecodeError"


def _start_consumers(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "fulmen.cli.main", "consume", "--sink", "spans"]
    with open(log, "ab") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


async def test_kill_9_of_the_consumers_mid_stream_loses_and_doubles_nothing(
    settings: FulmenSettings, tmp_path: Path
) -> None:
    read_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {
        "FULMEN_KAFKA_BOOTSTRAP": settings.bootstrap,
        "FULMEN_KAFKA_TOPIC_PREFIX": settings.kafka.topic_prefix,
        "FULMEN_HOME": str(tmp_path),
        "FULMEN_CLICKHOUSE_READ_PORT": str(read_port),
    }
    log = tmp_path / "consume.log"
    process = _start_consumers(env, log)
    batches, per_batch = 60, 200
    async with gateway_running(settings) as gateway, httpx.AsyncClient() as client:
        url = f"http://127.0.0.1:{gateway.port}/v1/traces"
        for i in range(batches):
            body = make_request(per_batch, seed=i, marker="crash").SerializeToString()
            assert (await client.post(url, content=body, headers=PROTOBUF)).status_code == 200
            if i == batches // 2:
                reader = await _wait_reader(read_port)
                await _wait_count(reader, "crash", 1)  # the consumer is mid-stream
                process.send_signal(signal.SIGKILL)
                process.wait()
                process = _start_consumers(env, log)
    try:
        reader = await _wait_reader(read_port)
        total = batches * per_batch
        assert await _wait_count(reader, "crash", total) == total, log.read_text()[-3000:]
        doubled = reader.query(
            "SELECT count() FROM (SELECT SpanId FROM fulmen.otel_traces WHERE SpanAttributes['bench.marker'] = 'crash' "
            "GROUP BY TraceId, SpanId HAVING count() > 1)"
        ).rows[0][0]
        assert doubled == 0
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


async def _wait_reader(port: int, timeout_s: float = 60) -> RemoteReader:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reader = await asyncio.to_thread(RemoteReader.find, "127.0.0.1", port)
        if reader is not None:
            return reader
        await asyncio.sleep(0.3)
    raise AssertionError("the consumers process never served reads")


async def _wait_count(reader: RemoteReader, marker: str, expected: int, timeout_s: float = 90) -> int:
    sql = f"SELECT count() FROM fulmen.otel_traces WHERE SpanAttributes['bench.marker'] = '{marker}'"
    return await count_reaches(reader, sql, expected, timeout_s, every_s=0.3)


async def test_a_stopped_broker_means_503_and_the_exporter_retry_delivers(tmp_path: Path, store_path: Path) -> None:
    broker = LocalKafka(BrokerSettings(port=free_port(), controller_port=free_port()), tmp_path / "kafka")
    await asyncio.to_thread(broker.start)
    settings = FulmenSettings(
        home=tmp_path,
        kafka={"bootstrap": broker.bootstrap},
        clickhouse={"path": store_path, "database": f"t{tmp_path.name[-8:]}", "read_port": 0},
    )
    await ensure_topics(settings)
    store = Store.open(settings)
    store.migrate()
    try:
        async with gateway_running(settings, publish_timeout_s=1.0) as gateway:
            url = f"http://127.0.0.1:{gateway.port}/v1/traces"
            await asyncio.to_thread(broker.stop)
            async with httpx.AsyncClient() as client:
                refused = await client.post(url, content=make_request(3).SerializeToString(), headers=PROTOBUF)
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"

            def export_with_sdk() -> None:
                provider = TracerProvider(resource=Resource.create({"service.name": "retrying-agent"}))
                provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=url, timeout=60)))
                tracer = provider.get_tracer("t")
                for i in range(5):
                    with tracer.start_as_current_span(f"step {i}", attributes={"retry.marker": "yes"}):
                        pass
                provider.shutdown()

            exporting = asyncio.create_task(asyncio.to_thread(export_with_sdk))
            await asyncio.sleep(2.5)  # the exporter meets 503s and backs off
            assert not exporting.done() and gateway.stats.unavailable >= 2
            await asyncio.to_thread(broker.start)
            await asyncio.wait_for(exporting, 90)
        async with span_pipeline(settings, store) as pipeline:
            assert await pipeline.wait_spans("SpanAttributes['retry.marker'] = 'yes'", 5) == 5
            await asyncio.sleep(0.5)
            names = store.query(
                f"SELECT SpanName, count() FROM {store.database}.otel_traces WHERE SpanAttributes['retry.marker'] = 'yes' "
                "GROUP BY SpanName ORDER BY SpanName"
            ).rows
        assert names == [[f"step {i}", 1] for i in range(5)]
    finally:
        store.command(f"DROP DATABASE IF EXISTS {store.database}")
        await asyncio.to_thread(broker.stop)
