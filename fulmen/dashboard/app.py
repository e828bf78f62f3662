"""The dashboard's HTTP server (``fulmen dashboard``): static pages and the JSON they poll, read-only.

Lifecycle: :meth:`Dashboard.start` binds the port (``port=0`` picks a free one, see :attr:`Dashboard.port`) and
serves until :meth:`Dashboard.stop`; :meth:`Dashboard.run` does both around a stop event (the CLI's shape).
``GET /healthz`` answers 200 as soon as the server listens, with whether the store answers (``store``): the
dashboard starts before ``fulmen consume`` and shows the store's state instead of failing.

Routes: the pages (``/`` runs and their steps, ``/rollouts``, ``/rollout``, ``/models``, ``/prompts``,
``/dead-letters``), ``/static/*`` (one script, one stylesheet, uPlot vendored at install: no page needs the
internet; a Content-Security-Policy of ``'self'`` says so to the browser), and ``/api/*`` (JSON from
:class:`DashboardQueries`). A bad query parameter is a 400 naming it; a store that does not answer is a 503 with
the reason. Only GET is served. On loopback (the default) a request whose ``Host`` is not loopback is refused (DNS
rebinding), and so is a cross-site call of the API; there is no login, so beyond loopback put it behind a proxy
that has one.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from fulmen.dashboard.queries import DashboardQueries, FilterError, Reader, jsonable
from fulmen.infra.http import is_loopback, server_options
from fulmen.infra.settings import DashboardProcessSettings
from fulmen.infra.store import ReadOnlyError, RemoteReader, Store
from fulmen.schemas.errors import ConfigurationError, FulmenError, RetryableError

__all__ = ["Dashboard", "dashboard_reader"]

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
UPLOT = STATIC / "vendor" / "uPlot.iife.min.js"
# path -> (the page's name for the script, its title); every page is static/page.html, the script draws it
PAGES = {
    "/": ("runs", "Runs"),
    "/rollouts": ("rollouts", "Rollouts"),
    "/rollout": ("rollout", "Rollout"),
    "/models": ("models", "Models"),
    "/prompts": ("prompts", "Prompts"),
    "/dead-letters": ("dead", "Dead letters"),
}
_SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_READ_TIMEOUT_S = 30.0


def dashboard_reader(settings: DashboardProcessSettings) -> Reader:
    """Where the dashboard reads: the ClickHouse server, else the read endpoint of the embedded store's owner."""
    clickhouse = settings.clickhouse
    if clickhouse.url is not None:
        return Store.open(settings)
    if clickhouse.read_port == 0:
        raise ConfigurationError(
            "the dashboard reads the embedded store through the endpoint `fulmen consume` serves: "
            "FULMEN_CLICKHOUSE_READ_PORT must not be 0"
        )
    host = "127.0.0.1" if clickhouse.read_host in ("0.0.0.0", "::") else clickhouse.read_host
    token = clickhouse.read_token.get_secret_value() if clickhouse.read_token else None
    return RemoteReader(f"http://{host}:{clickhouse.read_port}", timeout_s=_READ_TIMEOUT_S, token=token)


class Dashboard:
    """Serves the pages and their JSON over ``queries``. Build with :meth:`from_settings` or inject a reader."""

    def __init__(self, queries: DashboardQueries, host: str, port: int, *, poll_s: float = 3.0) -> None:
        if not UPLOT.is_file():
            raise ConfigurationError(f"the dashboard's chart library is missing ({UPLOT}): run `make install`")
        self.queries = queries
        self.host = host
        self.port = port
        self.poll_s = poll_s
        self._runner: web.AppRunner | None = None
        self._owned: Any = None  # the reader from_settings opened, closed by stop()

    @classmethod
    def from_settings(cls, settings: DashboardProcessSettings) -> Dashboard:
        section, reader = settings.dashboard, dashboard_reader(settings)
        dashboard = cls(DashboardQueries(reader), section.host, section.port, poll_s=section.poll_s)
        dashboard._owned = reader
        return dashboard

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application(middlewares=[_security_headers, self._same_site])
        template = (STATIC / "page.html").read_text()
        for path, (name, title) in PAGES.items():
            app.router.add_get(path, self._page(template, name, title))
        app.router.add_get("/healthz", self._healthz)
        app.router.add_static("/static", STATIC, follow_symlinks=False)
        api: dict[str, Callable[[dict[str, str]], Any]] = {
            "/api/runs": lambda _: self.queries.runs(),
            "/api/steps": self.queries.steps,
            "/api/rollouts": self.queries.rollouts,
            "/api/rollout": self.queries.rollout,
            "/api/models": self.queries.models,
            "/api/prompts": self.queries.prompts,
            "/api/dead-letters": self.queries.dead_letters,
        }
        for path, read in api.items():
            app.router.add_get(path, self._api(read))
        self._runner = web.AppRunner(app, access_log=None, **server_options(_READ_TIMEOUT_S))
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        log.info("dashboard on %s (polling every %.1f s)", self.url, self.poll_s)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._owned is not None:
            self._owned.close()
            self._owned = None

    async def run(self, stop: asyncio.Event) -> None:
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()

    # --- who may ask --------------------------------------------------------------------------------------
    @web.middleware
    async def _same_site(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """On loopback, only this machine's pages: a ``Host`` that is not loopback (a DNS-rebinding page) is
        refused, and so are cross-site calls of the API (another site's script reading the store)."""
        if is_loopback(self.host) and not is_loopback(request.url.host or ""):
            return _error(403, f"Host {request.host!r} is not this dashboard's loopback address")
        if request.path.startswith("/api/") and request.headers.get("Sec-Fetch-Site", "none") not in (
            "none",
            "same-origin",
        ):
            return _error(403, "cross-site requests of the API are refused")
        return await handler(request)

    # --- routes -----------------------------------------------------------------------------------------
    def _page(self, template: str, name: str, title: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        fill = {"{{page}}": name, "{{title}}": title, "{{poll_ms}}": str(int(self.poll_s * 1000))}
        text = template
        for placeholder, value in fill.items():
            text = text.replace(placeholder, value)

        async def page(_: web.Request) -> web.Response:
            return web.Response(text=text, content_type="text/html")

        return page

    async def _healthz(self, _: web.Request) -> web.Response:
        try:
            await asyncio.to_thread(self.queries.reader.query, "SELECT 1", None, final=False, read_only=True)
            store = True
        except FulmenError:
            store = False
        return web.json_response({"status": "ok", "store": store})

    def _api(self, read: Callable[[dict[str, str]], Any]) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def answer(request: web.Request) -> web.Response:
            try:
                result = await asyncio.to_thread(read, dict(request.query))
            except (FilterError, ReadOnlyError) as exc:
                return _error(400, str(exc))
            except RetryableError as exc:
                return _error(503, f"the store did not answer: {exc}")
            except FulmenError as exc:
                return _error(502, str(exc))
            return web.Response(text=json.dumps(jsonable(result)), content_type="application/json")

        return answer


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=json.dumps({"error": message}), content_type="application/json")


@web.middleware
async def _security_headers(request: web.Request, handler: Any) -> web.StreamResponse:
    response = await handler(request)
    response.headers.update(_SECURITY_HEADERS)
    return response
