"""Shared HTTP guards for Fulmen's aiohttp services: body limits, read deadlines, bearer auth, URL masking.

What aiohttp 3.x bounds by itself, and what this module adds (checked against aiohttp 3.14's
``web_protocol.RequestHandler``):

* ``keepalive_timeout`` is armed when a connection opens and again after each response; when it fires while
  the connection still waits for a complete request line and headers, aiohttp closes it. It therefore bounds
  both idle keep-alive connections and clients that send their headers slowly (slowloris).
  :func:`server_options` sets it (aiohttp's default is 3630 s).
* ``max_line_size``, ``max_field_size`` and ``max_headers`` bound the request line and headers by size.
* ``client_max_size`` bounds a body read with ``request.read()`` (after gzip/deflate inflation) but only while
  reading it: a body that declares 100 MB is read up to the cap before the 413.
  :func:`body_limit_middleware` refuses it from ``Content-Length`` before a byte of the body is read.
* Nothing in aiohttp bounds the *time* a body takes to arrive once the headers are in (the handler runs and
  waits). :func:`read_body` adds that deadline (408) together with the size cap (413), and turns an
  undecodable transfer (corrupt gzip, broken chunking) into a 400 instead of a 500.
* aiohttp inflates ``Content-Encoding: gzip`` / ``deflate`` bodies itself but checks the end of the stream for
  deflate only: a truncated gzip stream reaches the handler as the prefix it decoded (``\x1f\x8b`` alone is
  an empty body), and bytes after the end of a stream are not reported as such. :func:`server_options` turns
  that inflation off (``auto_decompress=False``) and :func:`read_body` inflates with :mod:`zlib` itself:
  a truncated stream, a wrong checksum or trailing bytes are a 400 naming the problem, the inflated size is
  capped like the raw one (413, no zip bomb), and ``br``/``zstd`` are a 415.
* ``lingering_time``: after answering a request whose body was not read, aiohttp reads and discards the rest
  for up to this long (so the client sees the answer rather than a reset); :func:`server_options` keeps it short.

Usage::

    app = web.Application(client_max_size=max_bytes, middlewares=[
        body_limit_middleware(max_bytes), bearer_auth_middleware(token)])
    runner = web.AppRunner(app, **server_options(read_timeout_s=30))
    ...
    body = await read_body(request, max_bytes=max_bytes, timeout_s=30)
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import re
import zlib
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.web_protocol import RequestPayloadError

from fulmen.schemas.errors import ConfigurationError

__all__ = [
    "ErrorResponder",
    "bearer_auth_middleware",
    "body_limit_middleware",
    "is_loopback",
    "mask_url",
    "read_body",
    "serve",
    "server_options",
    "url_secrets",
]

log = logging.getLogger(__name__)

# (request, status, message, headers) -> the response in the service's own error shape.
ErrorResponder = Callable[[web.Request, int, str, dict[str, str]], web.StreamResponse]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_SECRET_PARAM = re.compile(r"pass|pwd|token|secret|key|auth|credential|signature|^sig$|session", re.IGNORECASE)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (``127.0.0.0/8``, ``::1``, bracketed or not)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def serve(app: web.Application, host: str, port: int, *, read_timeout_s: float, port_setting: str, what: str):
    """``app`` listening on ``host:port`` (0: any free port) with :func:`server_options`; returns ``(runner, port)``.
    A port that cannot be taken is a ConfigurationError naming ``port_setting``, the variable that chooses it."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False, **server_options(read_timeout_s))
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigurationError(
            f"cannot serve {what} on {host}:{port} ({exc.strerror}): set {port_setting} to a free port, or 0 to "
            "serve none"
        ) from exc
    sockets = site._server.sockets if site._server else []
    return runner, sockets[0].getsockname()[1] if sockets else port


def server_options(
    read_timeout_s: float, *, lingering_time_s: float = 2.0, shutdown_grace_s: float = 5.0
) -> dict[str, Any]:
    """Keyword arguments for ``web.AppRunner`` that bound how long a client may take to send its headers,
    and how long requests in flight may hold the service's shutdown.

    ``read_timeout_s`` becomes aiohttp's ``keepalive_timeout``: a connection that has not delivered a complete
    request line and headers within it (from the moment it opened, or since the last response) is closed.
    Body reads are bounded separately, by :func:`read_body`'s ``timeout_s``. ``shutdown_grace_s`` becomes
    ``shutdown_timeout`` (aiohttp's default is 60 s: a slow client kept SIGTERM waiting that long); handlers
    still running after it are cancelled.

    ``auto_decompress`` is off: handlers get gzip/deflate bodies as sent and must read them with
    :func:`read_body`, which inflates them and checks that the stream is whole (``request.read()`` and
    ``request.json()`` would see the compressed bytes).
    """
    if read_timeout_s <= 0:
        raise ValueError(f"read_timeout_s must be positive, not {read_timeout_s}")
    return {
        "keepalive_timeout": float(read_timeout_s),
        "lingering_time": float(lingering_time_s),
        "shutdown_timeout": float(shutdown_grace_s),
        "auto_decompress": False,
    }


def _plain_error(request: web.Request, status: int, message: str, headers: dict[str, str]) -> web.StreamResponse:
    return web.Response(status=status, text=message + "\n", headers=headers)


def body_limit_middleware(max_bytes: int, *, respond: ErrorResponder | None = None):
    """A middleware that answers 413 when ``Content-Length`` declares more than ``max_bytes``, before reading.

    Chunked bodies (no ``Content-Length``) are left to the reader: ``read_body`` or the application's
    ``client_max_size``. ``respond`` shapes the error (default: plain text).
    """
    answer = respond or _plain_error

    @web.middleware
    async def limit_body(request: web.Request, handler: Handler) -> web.StreamResponse:
        declared = request.content_length
        if declared is not None and declared > max_bytes:
            log.debug("refusing %s %s: Content-Length %d > %d", request.method, request.path, declared, max_bytes)
            response = answer(request, 413, f"body of {declared} bytes is over the {max_bytes}-byte limit", {})
            response.force_close()  # do not keep a connection whose body we will not read
            return response
        return await handler(request)

    return limit_body


async def read_body(request: web.Request, *, max_bytes: int, timeout_s: float) -> bytes:
    """The request's body (inflated when it is gzip/deflate-encoded), read within ``timeout_s`` seconds.

    Raises ``web.HTTPRequestEntityTooLarge`` (413) past ``max_bytes`` (declared, read, or once inflated),
    ``web.HTTPRequestTimeout`` (408) when the body does not arrive in time, ``web.HTTPBadRequest`` (400)
    when the transfer cannot be decoded (broken chunked encoding; a gzip/deflate stream that is corrupt,
    truncated or followed by other bytes) and ``web.HTTPUnsupportedMediaType`` (415) for a content coding
    aiohttp knows but this function does not inflate (``br``, ``zstd``).

    The stream checks need the raw body: run the server with :func:`server_options` (``auto_decompress``
    off). Under a runner that still lets aiohttp inflate, the body is returned as aiohttp inflated it.
    """
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=declared)
    coding = _content_coding(request)
    if coding in _NOT_INFLATED:
        error = web.HTTPUnsupportedMediaType(
            text=f"Content-Encoding {coding} is not supported; send gzip, deflate or an uncompressed body\n"
        )
        error.force_close()
        raise error
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await request.content.readany():
                body.extend(chunk)
                if len(body) > max_bytes:
                    raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=len(body))
    except TimeoutError:
        error = web.HTTPRequestTimeout(text=f"the body did not arrive within {timeout_s:g}s\n")
        error.force_close()
        raise error from None
    except (BadHttpMessage, RequestPayloadError) as exc:
        reason = getattr(exc, "message", "") or str(exc) or type(exc).__name__
        error = web.HTTPBadRequest(text=f"the body could not be read: {_encodable(reason)}\n")
        error.force_close()
        raise error from None
    if coding is None or not body or request.content.total_compressed_bytes is not None:
        return bytes(body)  # not compressed, empty, or already inflated by aiohttp (a runner without server_options)
    return await _inflate(bytes(body), coding, max_bytes)


# The codings aiohttp recognises (any other Content-Encoding value passes through it untouched, and here too).
_INFLATED = frozenset({"gzip", "deflate"})
_NOT_INFLATED = frozenset({"br", "zstd"})
_INFLATE_STEP = 1 << 20  # inflate at most this many bytes between two turns of the event loop
_GZIP_MAGIC = b"\x1f\x8b"
_ZLIB_REASONS = {  # zlib's words for a checksum failure, said plainly
    "incorrect data check": "checksum mismatch: the data does not match its CRC-32 (gzip) or Adler-32 (deflate)",
    "incorrect length check": "checksum mismatch: the inflated size does not match the gzip trailer's ISIZE",
}


def _content_coding(request: web.Request) -> str | None:
    """The body's coding when aiohttp would recognise it (its own rule: one ASCII token, case-insensitive)."""
    value = request.headers.get("Content-Encoding", "")
    coding = value.lower() if value.isascii() else ""
    return coding if coding in _INFLATED | _NOT_INFLATED else None


async def _inflate(data: bytes, coding: str, max_bytes: int) -> bytes:
    """``data`` inflated, in steps of ``_INFLATE_STEP`` output bytes with the event loop served in between.

    gzip may hold several members back to back (RFC 1952 section 2.2); deflate is zlib-framed (RFC 1950) or,
    as aiohttp also accepts, bare RFC 1951 data. 400 for a stream that is corrupt, ends early or is followed
    by anything else; 413 as soon as the output passes ``max_bytes``.
    """
    # deflate, aiohttp's rule: a first byte whose low nibble is not 8 (CM=deflate) starts a bare RFC 1951 stream
    wbits = 31 if coding == "gzip" else 15 if data[0] & 0x0F == 8 else -15
    inflater, pending, out = zlib.decompressobj(wbits), data, bytearray()
    while True:
        room = min(_INFLATE_STEP, max_bytes + 1 - len(out))
        try:
            piece = inflater.decompress(pending, room)
        except zlib.error as exc:
            detail = str(exc).partition(": ")[2] or str(exc)
            raise _bad_stream(coding, f"corrupt ({_ZLIB_REASONS.get(detail, detail)})") from None
        out += piece
        if len(out) > max_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=len(out))
        pending = inflater.unconsumed_tail
        if inflater.eof:
            rest = inflater.unused_data
            if not rest:
                return bytes(out)
            if coding != "gzip" or not rest.startswith(_GZIP_MAGIC):
                raise _bad_stream(coding, f"followed by {len(rest)} trailing bytes after the end of the stream")
            inflater, pending = zlib.decompressobj(wbits), rest  # the next gzip member
        elif not pending and len(piece) < room:  # all input taken, output not cut short: the stream ended early
            raise _bad_stream(coding, "truncated: the stream ends before its end marker")
        await asyncio.sleep(0)


def _bad_stream(coding: str, problem: str) -> web.HTTPBadRequest:
    error = web.HTTPBadRequest(text=f"the {coding} body is {problem}\n")
    error.force_close()
    return error


def bearer_auth_middleware(
    token: str | None,
    *,
    open_paths: frozenset[str] = frozenset({"/healthz"}),
    respond: ErrorResponder | None = None,
):
    """A middleware that requires ``Authorization: Bearer <token>`` on every path but ``open_paths``.

    With ``token`` None or empty it lets everything through. The comparison is constant-time
    (``hmac.compare_digest`` on UTF-8 bytes); a missing, malformed or undecodable header is a 401 carrying
    ``WWW-Authenticate: Bearer``, never a 500.
    """
    expected = token.encode() if token else None
    answer = respond or _plain_error

    @web.middleware
    async def require_bearer(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is None or request.path in open_paths or _bearer_matches(request, expected):
            return await handler(request)
        headers = {"WWW-Authenticate": 'Bearer realm="fulmen"'}
        return answer(request, 401, "missing or wrong bearer token", headers)

    return require_bearer


def _bearer_matches(request: web.Request, expected: bytes) -> bool:
    header = request.headers.get("Authorization", "")
    try:
        raw = header.encode("utf-8")  # aiohttp keeps undecodable bytes as lone surrogates: they fail here
    except UnicodeEncodeError:
        return False
    scheme, _, given = raw.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), expected)


def mask_url(url: str) -> str:
    """``url`` without credentials: the ``user:password@`` part removed, secret-looking query values as ``***``.

    Secret-looking: a parameter name containing pass, pwd, token, secret, key, auth, credential, signature or
    session (``password``, ``access_token``, ``api_key``, ``X-Amz-Signature``...). A URL that cannot be parsed
    is not echoed at all.
    """
    try:
        parts = urlsplit(url)
        host = parts.netloc.rpartition("@")[2]
        query = "&".join(_mask_param(param) for param in parts.query.split("&")) if parts.query else ""
        return urlunsplit((parts.scheme, host, parts.path, query, parts.fragment))
    except ValueError:
        return "<unparseable URL>"


def url_secrets(url: str) -> list[str]:
    """The secrets ``url`` carries (its password, secret-looking query values), to scrub from error texts."""
    try:
        parts = urlsplit(url)
        found = [parts.password or ""]
        found += [value for name, value in parse_qsl(parts.query) if _SECRET_PARAM.search(name)]
    except ValueError:
        return []
    return [secret for secret in found if secret]


def _mask_param(param: str) -> str:
    name, equals, _ = param.partition("=")
    if equals and _SECRET_PARAM.search(unquote(name)):
        return f"{name}=***"
    return param


def _encodable(text: str) -> str:
    """``text`` with anything UTF-8 cannot encode (lone surrogates) escaped, so it can go into a response."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
