"""Read-only SQL over HTTP for the embedded store, served by the process that owns it.

chdb lets one process open a store directory, so in local mode the consumers process serves reads to
everyone else (``fulmen sql``, reports, dashboards). Every query runs through the store's
:class:`~fulmen.infra.store.reads.SqlReader`: parsed by ClickHouse, allowed only if it is a read, bounded by the
``FULMEN_CLICKHOUSE_READ_*`` limits, and cancelled in the engine when its client goes away.

Routes:

* ``GET /ping``: who answers here (no query; open).
* ``GET /metrics``: the process's Prometheus metrics (:mod:`fulmen.infra.metrics`; open, like ``/ping``).
* ``POST /query`` with ``{"sql": "...", "final": true, "parameters": {...}}``: an Arrow IPC stream (exact
  types), used by :class:`RemoteReader`. ``parameters`` (optional) fill the query's ``%(name)s`` placeholders,
  bound before the check (:func:`~fulmen.infra.store.reads.bind_parameters`).
* ``GET|POST /?query=...`` in the manner of ClickHouse's HTTP interface, for curl and scripts:
  ``curl 'http://127.0.0.1:8124/?query=SELECT+count()+FROM+fulmen.otel_traces'``. The answer is in the
  query's own ``FORMAT`` if it has one, else in ``default_format`` (TabSeparated).

Who may ask: with ``FULMEN_CLICKHOUSE_READ_TOKEN`` set, every query needs ``Authorization: Bearer <token>``
(required when the endpoint listens beyond loopback). Without a token it listens on loopback only and refuses
requests a web page could make: a ``Host`` that is not this loopback address (DNS rebinding), an ``Origin``
of another site, or ``Sec-Fetch-Site: cross-site``. Only GET and POST are served.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pyarrow as pa
from aiohttp import web

from fulmen.infra.http import bearer_auth_middleware, body_limit_middleware, is_loopback, read_body, serve
from fulmen.infra.metrics import add_metrics_route
from fulmen.infra.store.reads import QueryResult, SqlReader
from fulmen.infra.store.sql_guard import ReadOnlyError
from fulmen.infra.store.store import Store
from fulmen.schemas.errors import ConfigurationError, PoisonInputError, RetryableError

__all__ = ["ReadEndpoint", "RemoteReader"]

log = logging.getLogger(__name__)

_MARKER = "fulmen-read-endpoint"
_ARROW_STREAM = "application/vnd.apache.arrow.stream"
_MAX_BODY_BYTES = 1024 * 1024
_READ_TIMEOUT_S = 30.0
_DISCONNECT_POLL_S = 0.2
_OPEN_PATHS = frozenset({"/ping", "/metrics"})  # no query, no data: answered to anyone


class ReadEndpoint:
    """Serves the store's :class:`SqlReader` over HTTP. ``port=0`` picks a free port (see :attr:`port`)."""

    def __init__(self, store: Store, host: str, port: int, *, token: str | None = None) -> None:
        if not token and not is_loopback(host):
            raise ConfigurationError(
                f"the read endpoint would listen on {host} without a token: set FULMEN_CLICKHOUSE_READ_TOKEN, "
                "or FULMEN_CLICKHOUSE_READ_HOST=127.0.0.1"
            )
        self.store = store
        self.reader: SqlReader = store.reader()
        self.host = host
        self.port = port
        self.token = token or None
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(
            client_max_size=_MAX_BODY_BYTES,
            middlewares=[
                body_limit_middleware(_MAX_BODY_BYTES),
                self._same_site_only,
                bearer_auth_middleware(self.token, open_paths=_OPEN_PATHS),
            ],
        )
        app.router.add_get("/ping", self._ping)
        add_metrics_route(app)
        app.router.add_post("/query", self._query)
        app.router.add_get("/", self._clickhouse_style)
        app.router.add_post("/", self._clickhouse_style)
        self._runner, self.port = await serve(
            app,
            self.host,
            self.port,
            read_timeout_s=_READ_TIMEOUT_S,
            port_setting="FULMEN_CLICKHOUSE_READ_PORT",
            what="reads",
        )
        log.info("read-only SQL for %s at http://%s:%d/", self.store.location, self.host, self.port)

    async def stop(self) -> None:
        self.reader.cancel_all()  # a long read must not hold the process's shutdown
        if self._runner is not None:
            await self._runner.cleanup()

    # --- who may ask ----------------------------------------------------------------------------------------
    @web.middleware
    async def _same_site_only(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path not in _OPEN_PATHS:
            refusal = self._cross_site(request)
            if refusal:
                log.warning("read endpoint refused %s %s: %s", request.method, request.path, refusal)
                return web.Response(status=403, text=f"{refusal}\n")
        return await handler(request)

    def _cross_site(self, request: web.Request) -> str | None:
        if request.headers.get("Sec-Fetch-Site", "none") not in ("none", "same-origin"):
            return "cross-site requests are refused"
        origin = request.headers.get("Origin")
        if origin is not None and origin != f"http://{request.host}":
            return f"requests from origin {origin!r} are refused"
        if self.token is None and not is_loopback(request.url.host or ""):
            return f"Host {request.host!r} is not this endpoint's loopback address"
        return None

    # --- routes ---------------------------------------------------------------------------------------------
    async def _ping(self, request: web.Request) -> web.Response:
        return web.json_response({"service": _MARKER, "database": self.store.database, "token": bool(self.token)})

    async def _query(self, request: web.Request) -> web.Response:
        body = await read_body(request, max_bytes=_MAX_BODY_BYTES, timeout_s=_READ_TIMEOUT_S)
        try:
            payload = json.loads(body)
            sql, final = payload["sql"], payload.get("final", True)
            parameters = payload.get("parameters") or {}
            if not isinstance(sql, str) or not isinstance(final, bool) or not isinstance(parameters, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError, RecursionError):
            return web.Response(status=400, text='body must be JSON {"sql": "...", "final": true, "parameters": {}}\n')
        return await self._answer(
            request, lambda tag: (self.reader.arrow_ipc(sql, parameters, final=final, tag=tag), None)
        )

    async def _clickhouse_style(self, request: web.Request) -> web.Response:
        sql = request.query.get("query", "")
        if request.method == "POST":
            body = await read_body(request, max_bytes=_MAX_BODY_BYTES, timeout_s=_READ_TIMEOUT_S)
            try:
                text = body.decode()
            except UnicodeDecodeError:
                return web.Response(status=400, text="the body must be UTF-8 SQL\n")
            sql = f"{sql}\n{text}" if sql else text
        fmt = request.query.get("default_format", "TabSeparated")
        final = request.query.get("final", "1") not in ("0", "false")
        return await self._answer(request, lambda tag: self.reader.raw(sql, fmt, final=final, tag=tag))

    async def _answer(self, request: web.Request, run: Any) -> web.Response:
        """Run the read off the loop; cancel it in the engine if the client leaves first."""
        tag = self.reader.new_tag()
        work = asyncio.ensure_future(asyncio.to_thread(run, tag))
        try:
            while not work.done():
                await asyncio.wait({work}, timeout=_DISCONNECT_POLL_S)
                transport = request.transport
                if not work.done() and (transport is None or transport.is_closing()):
                    self.reader.cancel(tag)
            data, fmt = work.result()
        except asyncio.CancelledError:
            self.reader.cancel(tag)
            raise
        except ReadOnlyError as exc:
            return _text(403, exc)
        except RetryableError as exc:
            return web.Response(status=503, text=f"{_encodable(str(exc))}\n", headers={"Retry-After": "1"})
        except PoisonInputError as exc:  # the engine's message is what the user needs
            return _text(400, exc)
        content_type = _ARROW_STREAM if fmt is None else "text/plain; charset=utf-8"
        return web.Response(body=data, headers={"Content-Type": content_type, "X-ClickHouse-Format": fmt or "Arrow"})


def _text(status: int, exc: Exception) -> web.Response:
    return web.Response(status=status, text=f"{_encodable(str(exc))}\n")


def _encodable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class RemoteReader:
    """Queries a :class:`ReadEndpoint`; answers like :meth:`Store.query`."""

    def __init__(self, base_url: str, timeout_s: float = 300.0, token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.location = base_url
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        # One client for every query (thread-safe, keeps connections): building one costs ~0.1 s (its TLS
        # context), which a dashboard polling several queries a second would pay on each.
        self._http = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    @classmethod
    def find(cls, host: str, port: int, token: str | None = None) -> RemoteReader | None:
        """The endpoint at host:port if one of ours answers there, else None."""
        if port == 0:
            return None
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        try:
            answer = httpx.get(f"{url}/ping", timeout=2.0)
            if answer.status_code == 200 and answer.json().get("service") == _MARKER:
                return cls(url, token=token)
        except (httpx.HTTPError, ValueError):
            return None
        return None

    def query(self, sql: str, parameters: Any = None, *, final: bool = True, read_only: bool = True) -> QueryResult:
        """Run a read there; ``parameters`` fill its ``%(name)s`` placeholders (bound by the endpoint)."""
        body = {"sql": sql, "final": final, "parameters": dict(parameters or {})}
        try:
            answer = self._http.post(f"{self.base_url}/query", json=body, headers=self._headers)
        except httpx.HTTPError as exc:
            raise RetryableError(f"the read endpoint at {self.base_url} did not answer: {exc}") from exc
        if answer.status_code == 401:
            raise ConfigurationError(
                f"the read endpoint at {self.base_url} wants a token: set FULMEN_CLICKHOUSE_READ_TOKEN"
            )
        if answer.status_code == 403:
            raise ReadOnlyError(answer.text.strip())
        if answer.status_code == 503:
            raise RetryableError(answer.text.strip())
        if answer.status_code != 200:
            raise PoisonInputError(f"query failed: {answer.text.strip()}")
        return QueryResult.from_arrow(pa.ipc.open_stream(answer.content).read_all())
