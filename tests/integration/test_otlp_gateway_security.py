"""The OTLP gateway under hostile input: 4xx with an encodable reason (never a 500), limits enforced before
reading, slow clients cut off, and a large body decoded off the event loop."""

from __future__ import annotations

import asyncio
import gzip
import json
import time

import httpx
import pytest
from google.rpc import status_pb2

from bench.otlp_payloads import make_request
from fulmen.infra.settings import FulmenSettings
from tests.integration.span_pipeline import gateway_running
from tests.raw_http import send_raw

pytestmark = [pytest.mark.integration, pytest.mark.security]

PROTOBUF = {"Content-Type": "application/x-protobuf"}
JSON = {"Content-Type": "application/json"}


async def _raw(port: int, payload: bytes, wait_s: float = 10.0) -> bytes:
    return await send_raw(port, payload, wait_s)


def _span_json(name: str = "s", key: str = "k") -> bytes:
    span = {
        "traceId": "01" * 16,
        "spanId": "02" * 8,
        "name": name,
        "attributes": [{"key": key, "value": {"stringValue": "v"}}],
    }
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}).encode()


async def test_hostile_bodies_get_a_4xx_with_an_encodable_reason(settings: FulmenSettings) -> None:
    async with gateway_running(settings) as gateway, httpx.AsyncClient(timeout=10) as client:
        url = f"http://127.0.0.1:{gateway.port}/v1/traces"
        gz = {"Content-Encoding": "gzip"}
        cases = [
            (b"\x1f\x8bnot gzip", PROTOBUF | gz),
            (gzip.compress(b"\x0a\x05hello")[:12] + b"\xff" * 8, PROTOBUF | gz),
            (b'{"resourceSpans": ' + b"[" * 1000 + b"]" * 1000 + b"}", JSON),
            (
                b'{"resourceSpans": [{"scopeSpans": [{"spans": ['
                + b'{"attributes": [{"value": {"kvlistValue": {"values": [' * 200
                + b"]}}}]}" * 200
                + b"]}]}]}",
                JSON,
            ),
            (_span_json(name="\\ud800").replace(b'"\\\\ud800"', b'"\\ud800"'), JSON),
            (_span_json(key="\\udfff").replace(b'"\\\\udfff"', b'"\\udfff"'), JSON),
            (b'{"resourceSpans": [{"\\ud800": 1}]}', JSON),
        ]
        for body, headers in cases:
            response = await client.post(url, content=body, headers=headers)
            assert 400 <= response.status_code < 500, (body[:60], response.status_code, response.text[:200])
            if response.headers["Content-Type"].startswith("application/json"):
                json.loads(response.text)
            else:
                status_pb2.Status.FromString(response.content)
        # A 2-byte gzip body (once hung past 10 s, then accepted as an empty export): a truncated stream.
        response = await client.post(url, content=b"\x1f\x8b", headers=PROTOBUF | gz)
        assert response.status_code == 400 and "truncated" in status_pb2.Status.FromString(response.content).message


async def test_gzip_bodies_are_checked_to_their_end_and_capped_once_inflated(settings: FulmenSettings) -> None:
    """The stock exporters send gzip: a stream cut short, a wrong CRC or trailing bytes are a 400 naming the
    problem (aiohttp took a truncated stream as the prefix it had decoded), and a bomb is a 413."""
    export = make_request(20, seed=9).SerializeToString()
    packed = gzip.compress(export)
    bad_crc = bytearray(packed)
    bad_crc[-8] ^= 0xFF
    bomb = gzip.compress(b"\x00" * (64 * 1024 * 1024), compresslevel=9)
    gz = {"Content-Encoding": "gzip"}
    async with (
        gateway_running(settings, max_body_bytes=1024 * 1024) as gateway,
        httpx.AsyncClient(timeout=30) as client,
    ):
        url = f"http://127.0.0.1:{gateway.port}/v1/traces"
        cases = [
            (packed[: len(packed) // 2], PROTOBUF, 400, "truncated"),
            (packed[:-1], PROTOBUF, 400, "truncated"),
            (bytes(bad_crc), PROTOBUF, 400, "checksum"),
            (packed + b"\x0a\x00", PROTOBUF, 400, "trailing"),
            (gzip.compress(_span_json())[:-6], JSON, 400, "truncated"),
            (bomb, PROTOBUF, 413, "after gzip inflation"),
        ]
        for body, kind, status, words in cases:
            response = await client.post(url, content=body, headers=kind | gz)
            assert response.status_code == status, (words, response.status_code, response.text[:200])
            if kind is JSON:
                message = json.loads(response.text)["message"]
            else:
                message = status_pb2.Status.FromString(response.content).message
            assert words in message, message
        assert gateway.stats.records == 0 and gateway.stats.spans_accepted == 0
        response = await client.post(url, content=packed, headers=PROTOBUF | gz)
        assert response.status_code == 200 and gateway.stats.spans_accepted == 20
        assert gateway.stats.records == 2  # 20 spans in traces of 10


async def test_undecodable_authorization_header_is_401(settings: FulmenSettings) -> None:
    async with gateway_running(settings, bearer_token="s3cret") as gateway:
        body = make_request(1).SerializeToString()
        head = b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
        answer = await _raw(
            gateway.port, head + b"Authorization: Bearer s3\xffcret\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        assert answer.startswith(b"HTTP/1.1 401") and b"WWW-Authenticate: Bearer" in answer
        answer = await _raw(
            gateway.port, head + b"Authorization: Bearer s3cret\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        assert answer.startswith(b"HTTP/1.1 200")


async def test_oversize_declaration_is_refused_before_reading_and_slow_bodies_time_out(
    settings: FulmenSettings,
) -> None:
    async with gateway_running(settings, read_timeout_s=1.0) as gateway:
        head = b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
        # 100 MB declared, nothing sent: the answer comes from the header alone.
        answer = await _raw(gateway.port, head + b"Content-Length: 104857600\r\n\r\n", wait_s=5)
        assert answer.startswith(b"HTTP/1.1 413")
        answer = await _raw(gateway.port, head + b"Content-Length: 1000\r\n\r\n\x0a\x05", wait_s=10)
        assert answer.startswith(b"HTTP/1.1 408")
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
        writer.write(head)  # the headers never end
        async with asyncio.timeout(15):  # liveness bound: the connection is closed, not held
            assert await reader.read() == b""
        writer.close()


async def _busiest_turn(stop: asyncio.Event) -> float:
    """The most CPU time the event loop's thread spent between two of this task's turns (seconds): what a
    request waiting for the loop waits at least, however idle the machine (wall time also counts the time the
    process waits for a core, which on a shared machine says little about the gateway)."""
    worst = 0.0
    while not stop.is_set():
        started = time.thread_time()
        await asyncio.sleep(0.002)
        worst = max(worst, time.thread_time() - started)
    return worst


async def test_healthz_answers_while_a_large_body_is_decoded(settings: FulmenSettings) -> None:
    body = make_request(10_000, spans_per_trace=1, seed=1).SerializeToString()  # ~12 MB, 10,000 traces
    async with (
        gateway_running(settings, max_body_bytes=32 * 1024 * 1024) as gateway,
        httpx.AsyncClient(timeout=120) as client,
    ):
        base = f"http://127.0.0.1:{gateway.port}"
        await client.get(f"{base}/healthz")  # the connection is open before the clock starts
        done = asyncio.Event()
        turns = asyncio.create_task(_busiest_turn(done))
        post = asyncio.create_task(client.post(f"{base}/v1/traces", content=body, headers=PROTOBUF))
        worst = 0.0
        while not post.done():
            started = time.perf_counter()
            assert (await client.get(f"{base}/healthz")).status_code == 200
            worst = max(worst, time.perf_counter() - started)
            await asyncio.sleep(0.01)
        done.set()
        assert (await post).status_code == 200
        assert gateway.stats.records == 10_000 and gateway.stats.spans_accepted == 10_000
        busiest = await turns
    print(
        f"OTLP body {len(body)} bytes: worst /healthz latency {worst * 1000:.0f} ms, busiest loop turn "
        f"{busiest * 1000:.0f} ms of CPU"
    )
    # The loop's thread never works 100 ms without a break (measured ~15 ms; before the decoding process and
    # the frozen heap, full garbage collections on that thread took 300-800 ms). Wall time gets a liveness bound
    # only (the issue measured a 6 s stall): it depends on how busy the machine is.
    assert busiest < 0.1
    assert worst < 5.0  # wall clock, with room for a loaded CI machine; the CPU bound above is the strict one
