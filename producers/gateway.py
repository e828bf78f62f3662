"""The lifecycle both gateways share: an aiohttp server in front of a Kafka producer.

:class:`Gateway` is the base of :class:`~fulmen.producers.llm_gateway.app.LlmGateway` and
:class:`~fulmen.producers.otlp_gateway.app.OtlpGateway`: it owns the server, the producer, ``/healthz`` and
``/readyz``, and the order of start and stop; a subclass adds its routes and its own resources (a model,
decoding processes) through the hooks named below. Build one, then :meth:`Gateway.run` it until an event is
set, or :meth:`Gateway.start` and :meth:`Gateway.stop` it inside another loop.

``start``, in order (a failure at any step stops what was started, then raises):

1. :meth:`Gateway._setup`: the subclass's resources;
2. the producer: connected before going on (:class:`~fulmen.schemas.errors.BrokerUnavailableError` when no
   broker answers within ``FULMEN_KAFKA_CONNECT_TIMEOUT_S``) or, with ``connect_in_background``, by a task
   that retries with backoff while the server already answers (the subclass refuses work with a 503 until
   :attr:`Gateway.connected` is set); :meth:`Gateway._on_connected` runs once it is connected;
3. listen: an aiohttp runner with the edges of :mod:`fulmen.infra.http` (body limit from ``Content-Length``,
   bearer token on every path but ``/healthz`` and ``/readyz``, read deadlines, a short shutdown grace).

``stop``, in order (safe after a failed start, and twice): stop accepting connections and let the requests in
flight finish (aiohttp's shutdown grace, :func:`~fulmen.infra.http.server_options`); end the background
tasks (:meth:`Gateway.spawn`; they see :attr:`Gateway.stopping`, and are cancelled after 5 s); flush and close
the producer; :meth:`Gateway._teardown`.

``GET /healthz`` answers 200 while the process runs; ``GET /readyz`` 200 once the producer is connected, else
503 with ``Retry-After``; ``GET /metrics`` the Prometheus metrics (:mod:`fulmen.producers.metrics`: every request
counted by route and status and timed), unless ``FULMEN_METRICS_ENABLED=false``. Every gateway counts at least
:class:`GatewayStats`; each extends it.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web
from aiokafka import AIOKafkaProducer
from pydantic import SecretStr

from fulmen.infra.http import ErrorResponder, bearer_auth_middleware, body_limit_middleware, server_options
from fulmen.infra.kafka.clients import close_quietly, start_or_raise
from fulmen.infra.metrics import add_metrics_route
from fulmen.infra.settings import FulmenSettings
from fulmen.producers.metrics import request_metrics_middleware
from fulmen.schemas.errors import BrokerUnavailableError

__all__ = ["OPEN_PATHS", "Gateway", "GatewayStats", "ListenOptions"]

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})  # answered without the bearer token
_TASK_GRACE_S = 5.0
_RETRY_FIRST_S, _RETRY_MAX_S = 0.5, 10.0


class ListenOptions(Protocol):
    """The settings a gateway's section has for its HTTP edge (``FULMEN_OTLP_*``, ``FULMEN_LLM_*``)."""

    host: str
    port: int
    bearer_token: SecretStr | None
    max_body_bytes: int
    read_timeout_s: float


@dataclass
class GatewayStats:
    """What every gateway counts; each gateway's stats extend it with their own fields."""

    requests: int = 0  # requests to the gateway's own routes (not /healthz, /readyz)
    records: int = 0  # records Kafka acknowledged
    unavailable: int = 0  # answered 503 because Kafka did not take the data (or was not connected)


class Gateway(abc.ABC):
    """An aiohttp server whose answers wait for its Kafka producer; the lifecycle is in the module docstring.

    Subclasses set :attr:`name` and implement :meth:`_add_routes`; the other hooks do nothing by default.
    """

    name = "gateway"  # in log lines and errors: "LLM gateway", "OTLP gateway"
    metrics_label = "gateway"  # the ``gateway`` label of its metrics: "llm", "otlp"
    stats: GatewayStats  # set by the subclass, to its own extension of GatewayStats

    def __init__(
        self,
        settings: FulmenSettings,
        options: ListenOptions,
        kafka_producer: AIOKafkaProducer,
        *,
        topic: str,
        respond: ErrorResponder,
        connect_in_background: bool = False,
    ) -> None:
        self.settings = settings
        self.options = options
        self.producer = kafka_producer
        self.topic = topic  # where its records go (named in the start-up line)
        self.respond = respond  # the HTTP guards' errors (401, 413) in the gateway's own shape
        self.connect_in_background = connect_in_background
        self.connected = asyncio.Event()
        self.stopping = asyncio.Event()
        self.port: int | None = None
        self._runner: web.AppRunner | None = None
        self._connector: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._stopped = False

    # --- hooks ----------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _add_routes(self, app: web.Application) -> None:
        """Add the gateway's own routes (``/healthz`` and ``/readyz`` are added for it)."""

    async def _setup(self) -> None:  # noqa: B027 (optional hook, empty by default)
        """Before the producer connects: load what the routes need."""

    async def _on_connected(self) -> None:  # noqa: B027 (optional hook)
        """Once the producer is connected (before listening, unless connecting in the background)."""

    async def _teardown(self) -> None:  # noqa: B027 (optional hook)
        """Last step of :meth:`stop`, after the producer is closed: release what :meth:`_setup` took."""

    def _description(self) -> str:
        """The gateway as the start-up log line names it."""
        return self.name

    # --- lifecycle ------------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        token = self.options.bearer_token.get_secret_value() if self.options.bearer_token else None
        measured = [request_metrics_middleware(self.metrics_label)] if self.settings.metrics.enabled else []
        app = web.Application(
            client_max_size=self.options.max_body_bytes,
            middlewares=[
                *measured,
                # Content-Length is the size as sent (compressed, for gzip): this refuses only what cannot fit
                # inflated either; read_body caps the inflated size.
                body_limit_middleware(self.options.max_body_bytes, respond=self.respond),
                bearer_auth_middleware(token, open_paths=OPEN_PATHS, respond=self.respond),
            ],
        )
        self._add_routes(app)
        app.router.add_get("/healthz", self.handle_health)
        app.router.add_get("/readyz", self.handle_ready)
        if self.settings.metrics.enabled:
            add_metrics_route(app)
        return app

    async def start(self) -> None:
        """Set up, connect the producer (or start connecting it), listen; see the module docstring.

        Raises :class:`~fulmen.schemas.errors.ConfigurationError` or
        :class:`~fulmen.schemas.errors.BrokerUnavailableError` (after stopping what was started).
        """
        try:
            await self._setup()
            if self.connect_in_background:
                self._connector = asyncio.create_task(self._connect_until_connected(), name=f"{self.name} connect")
            else:
                await self._connect()
            await self._listen()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Stop accepting, finish what is in flight, close the producer, release the subclass's resources."""
        if self._stopped:
            return
        self._stopped = True
        self.stopping.set()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()  # closes the listening socket, then waits for handlers (shutdown grace)
        if self._connector is not None:
            self._connector.cancel()
        await self._end_tasks()
        await close_quietly([self.producer])  # flushes what the producer still holds
        await self._teardown()

    async def run(self, stop: asyncio.Event) -> None:
        """Start, serve until ``stop`` is set, stop."""
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()

    def spawn(self, work: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``work`` in the background until :meth:`stop` (it should return once :attr:`stopping` is set)."""
        task = asyncio.create_task(work, name=name)
        self._tasks.append(task)
        return task

    async def _connect(self) -> None:
        await start_or_raise(self.producer, self.settings, f"{self.name} producer")
        self.connected.set()
        await self._on_connected()

    async def _connect_until_connected(self) -> None:
        delay = _RETRY_FIRST_S
        while True:
            try:
                await start_or_raise(self.producer, self.settings, f"{self.name} producer")
            except BrokerUnavailableError as exc:
                log.warning("%s; retrying in %gs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_S)
                continue
            self.connected.set()
            log.info("%s connected to Kafka at %s", self.name, self.settings.bootstrap)
            await self._on_connected()
            return

    async def _listen(self) -> None:
        self._runner = web.AppRunner(
            self.app(), access_log=None, handle_signals=False, **server_options(self.options.read_timeout_s)
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.options.host, self.options.port, backlog=1024)
        await site.start()
        sockets = site._server.sockets if site._server else []
        self.port = sockets[0].getsockname()[1] if sockets else self.options.port
        log.info(
            "%s listening on http://%s:%d -> topic %s", self._description(), self.options.host, self.port, self.topic
        )

    async def _end_tasks(self) -> None:
        tasks, self._tasks = self._tasks, []
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=_TASK_GRACE_S)
        for task in pending:
            log.warning(
                "%s: %s did not end within %.0fs of stopping; cancelled", self.name, task.get_name(), _TASK_GRACE_S
            )
            task.cancel()
        if pending:
            await asyncio.wait(pending)

    # --- probes ---------------------------------------------------------------------------------------------
    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def handle_ready(self, request: web.Request) -> web.Response:
        if self.connected.is_set():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="not connected to Kafka\n", headers={"Retry-After": "1"})
