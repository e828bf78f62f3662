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
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.web_protocol import RequestPayloadError

__all__ = [
    "ErrorResponder",
    "bearer_auth_middleware",
    "body_limit_middleware",
    "mask_url",
    "read_body",
    "server_options",
    "url_secrets",
]

log = logging.getLogger(__name__)

# (request, status, message, headers) -> the response in the service's own error shape.
ErrorResponder = Callable[[web.Request, int, str, dict[str, str]], web.StreamResponse]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_SECRET_PARAM = re.compile(r"pass|pwd|token|secret|key|auth|credential|signature|^sig$|session", re.IGNORECASE)


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
    """
    if read_timeout_s <= 0:
        raise ValueError(f"read_timeout_s must be positive, not {read_timeout_s}")
    return {
        "keepalive_timeout": float(read_timeout_s),
        "lingering_time": float(lingering_time_s),
        "shutdown_timeout": float(shutdown_grace_s),
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

    Raises ``web.HTTPRequestEntityTooLarge`` (413) past ``max_bytes`` (declared or read),
    ``web.HTTPRequestTimeout`` (408) when the body does not arrive in time, and ``web.HTTPBadRequest`` (400)
    when the transfer cannot be decoded (corrupt gzip, broken chunked encoding).
    """
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=declared)
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
    return bytes(body)


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
