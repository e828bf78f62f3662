"""Prometheus metrics: how every Fulmen service tells an operator what it does, in the Prometheus text format.

The metrics are registered where the work happens (:mod:`fulmen.producers.metrics` for the gateways and the runner,
:mod:`fulmen.consumers.metrics`, :mod:`fulmen.algorithm.service.metrics`, the dead letters in
:mod:`fulmen.infra.kafka.dlq`), in ``prometheus_client``'s process-wide registry. This module serves them:

* :func:`add_metrics_route`: ``GET /metrics`` on a service's own aiohttp server (both gateways, the read endpoint
  of ``fulmen consume``). It is open like ``/healthz`` (no bearer token): the metrics carry counts and versions,
  never a payload, an id or a secret;
* :class:`MetricsListener`: a small aiohttp server with ``/metrics`` alone, for the processes that have no server
  of their own (the runner, the trainer, ``fulmen consume`` against a ClickHouse server), on
  ``FULMEN_METRICS_HOST``:``FULMEN_METRICS_PORT`` (0, the default: none);
* probes: what is worth reading only when someone scrapes (the consumers' lag asks Kafka for the partitions' high
  watermarks). An async function given to :func:`add_probe` is awaited before each answer, at most
  :data:`PROBE_TIMEOUT_S`; one that fails or is late leaves its last values in place.

Names follow Prometheus' conventions: the ``fulmen_`` prefix, base units (seconds), ``_total`` counters, and no
rollout, trace or response id as a label. ``FULMEN_METRICS_ENABLED=false`` turns off what the gateways record per
call (``bench/gateway_overhead.py`` measures both) and their ``/metrics`` route.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from fulmen.infra.http import serve
from fulmen.infra.settings import MetricsSettings

__all__ = [
    "LATENCY_BUCKETS",
    "PROBE_TIMEOUT_S",
    "MetricsListener",
    "add_metrics_route",
    "add_probe",
    "metrics_response",
    "remove_probe",
]

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0
# seconds: from half a millisecond (what a gateway adds to a call) to two minutes (a long generation)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

Probe = Callable[[], Awaitable[None]]
_probes: dict[int, Probe] = {}


def add_probe(probe: Probe) -> int:
    """Await ``probe`` before every scrape of this process until :func:`remove_probe` with the handle returned."""
    handle = id(probe)
    _probes[handle] = probe
    return handle


def remove_probe(handle: int) -> None:
    _probes.pop(handle, None)


async def _run_probes() -> None:
    probes = list(_probes.values())
    if not probes:
        return
    done = await asyncio.gather(
        *(asyncio.wait_for(probe(), PROBE_TIMEOUT_S) for probe in probes), return_exceptions=True
    )
    for outcome in done:
        if isinstance(outcome, BaseException):
            log.debug("a metrics probe failed: %s", outcome or type(outcome).__name__)


async def metrics_response(request: web.Request) -> web.Response:
    """``GET /metrics``: every metric of this process in the Prometheus text format, probes awaited first."""
    await _run_probes()
    body = await asyncio.to_thread(generate_latest, REGISTRY)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_metrics_route(app: web.Application) -> None:
    app.router.add_get("/metrics", metrics_response)


class MetricsListener:
    """``/metrics`` (and ``/healthz``) on ``host:port`` for a process without a server of its own; ``port=0`` in
    :meth:`from_settings` means none, ``port=0`` given here picks a free one (see :attr:`port`)."""

    def __init__(self, host: str, port: int, *, what: str) -> None:
        self.host, self.port, self.what = host, port, what
        self.started_at = time.time()
        self._runner: web.AppRunner | None = None

    @classmethod
    def from_settings(cls, settings: MetricsSettings, *, what: str) -> MetricsListener | None:
        if not settings.enabled or settings.port == 0:
            return None
        return cls(settings.host, settings.port, what=what)

    async def start(self) -> None:
        app = web.Application()
        add_metrics_route(app)
        app.router.add_get("/healthz", _healthz)
        self._runner, self.port = await serve(
            app,
            self.host,
            self.port,
            read_timeout_s=30.0,
            port_setting="FULMEN_METRICS_PORT",
            what=f"{self.what}'s metrics",
        )
        log.info("%s: Prometheus metrics at http://%s:%d/metrics", self.what, self.host, self.port)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> MetricsListener:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")
