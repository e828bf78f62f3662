"""infra/http.py: body limits before reading, read deadlines, bearer auth, URL masking (a loopback server only)."""

from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fulmen.infra.http import bearer_auth_middleware, body_limit_middleware, mask_url, read_body, server_options
from tests.raw_http import send_raw

pytestmark = pytest.mark.security

LIMIT = 64 * 1024
RECEIVED = web.AppKey("received", list)


def _app(token: str | None = None, read_timeout_s: float = 5.0) -> web.Application:
    received: list[int] = []

    async def echo(request: web.Request) -> web.Response:
        body = await read_body(request, max_bytes=LIMIT, timeout_s=read_timeout_s)
        received.append(len(body))
        return web.Response(text=str(len(body)))

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(
        client_max_size=LIMIT, middlewares=[body_limit_middleware(LIMIT), bearer_auth_middleware(token)]
    )
    app.router.add_post("/echo", echo)
    app.router.add_get("/healthz", health)
    app[RECEIVED] = received
    return app


async def _raw(port: int, payload: bytes, wait_s: float = 5.0) -> bytes:
    return await send_raw(port, payload, wait_s)


async def _server(app: web.Application, **options) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, **(options or server_options(read_timeout_s=5)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


@asynccontextmanager
async def _serving(app: web.Application) -> AsyncIterator[aiohttp.ClientSession]:
    """A client of ``app`` served as the services serve it (``server_options``: aiohttp does not inflate)."""
    runner, port = await _server(app)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
            yield session
    finally:
        await runner.cleanup()


async def test_declared_oversize_body_is_refused_before_reading() -> None:
    app = _app()
    runner, port = await _server(app)
    try:
        # Declares 100 MB, sends nothing: the 413 must come at once, from the header alone.
        answer = await _raw(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 104857600\r\n\r\n", wait_s=3)
        assert answer.startswith(b"HTTP/1.1 413")
        assert app[RECEIVED] == []
    finally:
        await runner.cleanup()


async def test_chunked_oversize_body_gets_413_and_normal_body_passes() -> None:
    async with TestClient(TestServer(_app())) as client:

        async def chunks():
            for _ in range(4):
                yield b"x" * (LIMIT // 2)

        response = await client.post("/echo", data=chunks())
        assert response.status == 413
        response = await client.post("/echo", data=b"y" * 100)
        assert response.status == 200 and await response.text() == "100"


async def test_slow_body_gets_408() -> None:
    runner, port = await _server(_app(read_timeout_s=0.5))
    try:
        answer = await _raw(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc", wait_s=5)
        assert answer.startswith(b"HTTP/1.1 408")
    finally:
        await runner.cleanup()


async def test_slow_headers_are_cut_off_by_the_read_timeout() -> None:
    runner, port = await _server(_app(), **server_options(read_timeout_s=0.5))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        await writer.drain()
        async with asyncio.timeout(10):  # liveness bound: aiohttp's default would hold it for an hour
            assert await reader.read() == b""  # the server closed the connection
        writer.close()
    finally:
        await runner.cleanup()


async def test_corrupt_gzip_body_is_a_400() -> None:
    async with _serving(_app()) as client:
        for body in (b"\x1f\x8bnot gzip at all", b"\x1f\x8b\x08\x00garbage" * 3, b"plain"):
            response = await client.post("/echo", data=body, headers={"Content-Encoding": "gzip"})
            assert response.status == 400, body
        response = await client.post("/echo", data=gzip.compress(b"hello"), headers={"Content-Encoding": "gzip"})
        assert response.status == 200 and await response.text() == "5"


def _bad_crc(data: bytes) -> bytes:
    """A gzip member whose CRC-32 (bytes -8..-4 of the trailer) does not match its content."""
    member = bytearray(gzip.compress(data))
    member[-8] ^= 0xFF
    return bytes(member)


_HELLO = gzip.compress(b"hello world " * 100)


@pytest.mark.parametrize(
    ("body", "encoding", "words"),
    [
        (b"\x1f\x8b", "gzip", "truncated"),  # aiohttp inflated this to an empty body: a 200
        (_HELLO[:-4], "gzip", "truncated"),  # the trailer cut short
        (_HELLO[: len(_HELLO) // 2], "gzip", "truncated"),  # cut in the middle of the deflate data
        (_bad_crc(b"hello world " * 100), "gzip", "checksum"),
        (_HELLO + b"trailing garbage", "gzip", "trailing"),
        (_HELLO + b"\x00" * 8, "gzip", "trailing"),
        (zlib.compress(b"hello world " * 100)[:-3], "deflate", "truncated"),
        (zlib.compress(b"hello") + b"junk", "deflate", "trailing"),
    ],
    ids=[
        "magic-only",
        "short-trailer",
        "half",
        "bad-crc",
        "garbage-after",
        "zeros-after",
        "deflate-cut",
        "deflate-junk",
    ],
)
async def test_truncated_or_corrupt_compressed_body_is_a_400_naming_the_problem(
    body: bytes, encoding: str, words: str
) -> None:
    app = _app()
    async with _serving(app) as client:
        response = await client.post("/echo", data=body, headers={"Content-Encoding": encoding})
        text = await response.text()
        assert response.status == 400, (response.status, text)
        assert words in text and encoding in text, text
    assert app[RECEIVED] == []  # the handler never saw a prefix of the body


async def test_compressed_body_inflating_past_the_limit_is_a_413() -> None:
    """A gzip bomb: ~70 bytes that inflate to 64 MiB; refused once the inflated size passes the cap."""
    app = _app()
    bomb = gzip.compress(b"\x00" * (64 * 1024 * 1024), compresslevel=9)
    assert len(bomb) < LIMIT
    async with _serving(app) as client:
        for body, encoding in ((bomb, "gzip"), (zlib.compress(b"\x00" * (LIMIT + 1)), "deflate")):
            response = await client.post("/echo", data=body, headers={"Content-Encoding": encoding})
            assert response.status == 413, encoding
        exact = gzip.compress(b"z" * LIMIT)  # exactly at the cap: accepted
        response = await client.post("/echo", data=exact, headers={"Content-Encoding": "gzip"})
        assert response.status == 200 and await response.text() == str(LIMIT)
    assert app[RECEIVED] == [LIMIT]


async def test_good_compressed_bodies_are_inflated() -> None:
    payload = bytes(range(256)) * 200  # 51,200 bytes
    deflater = zlib.compressobj(wbits=-15)
    raw_deflate = deflater.compress(payload) + deflater.flush()
    cases = [
        (gzip.compress(payload), "gzip"),
        (gzip.compress(payload[:1000]) + gzip.compress(payload[1000:]), "gzip"),  # two members (RFC 1952 2.2)
        (zlib.compress(payload), "deflate"),  # RFC 1950 zlib framing, as the RFC says
        (raw_deflate, "deflate"),  # bare RFC 1951 data, as some clients send it (aiohttp accepted both)
        (gzip.compress(payload), "GZIP"),
        (b"", "gzip"),  # no body at all
        (payload, "identity"),
    ]
    async with _serving(_app()) as client:
        for body, encoding in cases:
            response = await client.post("/echo", data=body, headers={"Content-Encoding": encoding})
            expected = "0" if not body else str(len(payload))
            assert response.status == 200 and await response.text() == expected, encoding

        async def chunks():  # chunked transfer of a gzip body: inflated the same way
            data = gzip.compress(payload)
            for start in range(0, len(data), 1000):
                yield data[start : start + 1000]

        response = await client.post("/echo", data=chunks(), headers={"Content-Encoding": "gzip"})
        assert response.status == 200 and await response.text() == str(len(payload))


async def test_unsupported_content_coding_is_a_415() -> None:
    async with _serving(_app()) as client:
        for encoding in ("br", "zstd"):
            response = await client.post("/echo", data=b"\x00" * 16, headers={"Content-Encoding": encoding})
            assert response.status == 415 and encoding in await response.text(), encoding


def test_server_options_leave_inflation_to_read_body() -> None:
    assert server_options(read_timeout_s=7)["auto_decompress"] is False


async def test_bearer_token_is_required_and_checked() -> None:
    async with TestClient(TestServer(_app(token="s3cret"))) as client:
        assert (await client.get("/healthz")).status == 200  # open path
        for headers in (
            {},
            {"Authorization": "Bearer nope"},
            {"Authorization": "Basic s3cret"},
            {"Authorization": "s3cret"},
        ):
            response = await client.post("/echo", data=b"", headers=headers)
            assert response.status == 401
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
        response = await client.post("/echo", data=b"ab", headers={"Authorization": "Bearer s3cret"})
        assert response.status == 200
        response = await client.post("/echo", data=b"ab", headers={"Authorization": "bearer  s3cret "})
        assert response.status == 200


async def test_undecodable_authorization_header_is_401_not_500() -> None:
    runner, port = await _server(_app(token="s3cret"))
    try:
        for header in (b"Bearer \xff\xfe", b"\xc3\x28", b"Bearer s3cret\x80"):
            request = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nAuthorization: " + header + b"\r\n\r\n"
            answer = await _raw(port, request)
            assert answer.startswith(b"HTTP/1.1 401"), answer[:80]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("http://user:pw@host:8123/db", "http://host:8123/db"),
        ("https://host/db?password=hunter2&x=1", "https://host/db?password=***&x=1"),
        ("https://a:b@host/v1?api_key=k&access_token=t&user=u", "https://host/v1?api_key=***&access_token=***&user=u"),
        ("http://[::1]:8000/v1?Secret=s", "http://[::1]:8000/v1?Secret=***"),
        ("http://host:8000/v1", "http://host:8000/v1"),
        ("http://host?X-Amz-Signature=abc&key=1", "http://host?X-Amz-Signature=***&key=***"),
        ("http://[bad", "<unparseable URL>"),
    ],
)
def test_mask_url_removes_credentials(url: str, masked: str) -> None:
    assert mask_url(url) == masked
    for secret in ("pw", "hunter2", "api_key=k", "=t&"):
        assert secret not in mask_url(url) or secret in masked


def test_server_options_bound_the_header_read() -> None:
    options = server_options(read_timeout_s=7)
    assert options["keepalive_timeout"] == 7.0
    with pytest.raises(ValueError, match="read_timeout_s"):
        server_options(read_timeout_s=0)


async def test_a_slow_client_does_not_hold_the_shutdown() -> None:
    """A request waiting 60 s for its body used to keep the service from stopping for aiohttp's 60 s default."""
    import time

    runner, port = await _server(_app(read_timeout_s=60), **server_options(read_timeout_s=60, shutdown_grace_s=1))
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
    await writer.drain()
    await asyncio.sleep(0.3)  # the handler now waits for the rest of the body
    started = time.monotonic()
    await runner.cleanup()
    writer.close()
    assert time.monotonic() - started < 15  # a liveness bound: the grace is 1 s, the body deadline 60 s
