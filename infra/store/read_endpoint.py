"""Read-only SQL over HTTP for the embedded store, served by the process that owns it.

chdb lets one process open a store directory, so in local mode the consumers process serves reads to
everyone else (``fulmen sql``, reports, dashboards). Two routes, both refusing writes and DDL:

* ``POST /query`` with ``{"sql": "...", "final": true}`` answers an Arrow IPC stream (exact types), used
  by :class:`RemoteReader`;
* ``GET|POST /?query=...`` in the manner of ClickHouse's HTTP interface, answering in ``default_format``
  (TabSeparated unless the query says ``FORMAT ...``), for curl and scripts:
  ``curl 'http://127.0.0.1:8124/?query=SELECT+count()+FROM+fulmen.otel_traces'``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pyarrow as pa
from aiohttp import web

from infra.errors import ConfigurationError, PoisonInputError, RetryableError
from infra.store.store import QueryResult, Store

__all__ = ["ReadEndpoint", "RemoteReader"]

log = logging.getLogger(__name__)

_MARKER = "fulmen-read-endpoint"
_ARROW_STREAM = "application/vnd.apache.arrow.stream"


class ReadEndpoint:
    """Serves :meth:`Store.query_raw` over HTTP. ``port=0`` picks a free port (see :attr:`port`)."""

    def __init__(self, store: Store, host: str, port: int) -> None:
        self.store = store
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=1024 * 1024)
        app.router.add_get("/ping", self._ping)
        app.router.add_post("/query", self._query)
        app.router.add_route("*", "/", self._clickhouse_style)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise ConfigurationError(
                f"cannot serve reads on {self.host}:{self.port} ({exc.strerror}): set FULMEN_CLICKHOUSE_READ_PORT "
                "to a free port, or 0 to serve none"
            ) from exc
        sockets = site._server.sockets if site._server else []
        self.port = sockets[0].getsockname()[1] if sockets else self.port
        log.info("read-only SQL for %s at http://%s:%d/", self.store.location, self.host, self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _ping(self, request: web.Request) -> web.Response:
        return web.json_response({"service": _MARKER, "store": self.store.location, "database": self.store.database})

    async def _query(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            sql, final = str(body["sql"]), bool(body.get("final", True))
        except (ValueError, KeyError, TypeError):
            return web.Response(status=400, text='body must be JSON {"sql": "...", "final": true}\n')
        return await self._run(sql, "ArrowStream", final, _ARROW_STREAM)

    async def _clickhouse_style(self, request: web.Request) -> web.Response:
        sql = request.query.get("query", "")
        if request.method == "POST":
            body = (await request.read()).decode(errors="replace")
            sql = f"{sql}\n{body}" if sql else body
        fmt = request.query.get("default_format", "TabSeparated")
        final = request.query.get("final", "1") not in ("0", "false")
        return await self._run(sql.strip(), fmt, final, "text/plain; charset=utf-8")

    async def _run(self, sql: str, fmt: str, final: bool, content_type: str) -> web.Response:
        try:
            data = await asyncio.to_thread(self.store.query_raw, sql, fmt, final=final, read_only=True)
        except PoisonInputError as exc:
            return web.Response(status=403, text=f"{exc}\n")
        except Exception as exc:  # the engine's message is what the user needs
            return web.Response(status=400, text=f"{exc}\n")
        return web.Response(body=data, headers={"Content-Type": content_type})


class RemoteReader:
    """Queries a :class:`ReadEndpoint`; answers like :meth:`Store.query`."""

    def __init__(self, base_url: str, timeout_s: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.location = base_url

    @classmethod
    def find(cls, host: str, port: int) -> RemoteReader | None:
        """The endpoint at host:port if one of ours answers there, else None."""
        if port == 0:
            return None
        url = f"http://{host}:{port}"
        try:
            answer = httpx.get(f"{url}/ping", timeout=2.0)
            if answer.status_code == 200 and answer.json().get("service") == _MARKER:
                return cls(url)
        except (httpx.HTTPError, ValueError, json.JSONDecodeError):
            return None
        return None

    def query(self, sql: str, parameters: Any = None, *, final: bool = True, read_only: bool = True) -> QueryResult:
        if parameters:
            raise ValueError("the read endpoint takes no query parameters: inline them")
        try:
            answer = httpx.post(f"{self.base_url}/query", json={"sql": sql, "final": final}, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            raise RetryableError(f"the read endpoint at {self.base_url} did not answer: {exc}") from exc
        if answer.status_code == 403:
            raise PoisonInputError(answer.text.strip())
        if answer.status_code != 200:
            raise PoisonInputError(f"query failed: {answer.text.strip()}")
        table = pa.ipc.open_stream(answer.content).read_all()
        columns = [column.to_pylist() for column in table.columns]
        return QueryResult(table.column_names, [list(row) for row in zip(*columns, strict=True)])
