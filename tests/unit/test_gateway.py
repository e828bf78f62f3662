"""The lifecycle the gateways share, against a fake producer: probes, start and stop order, a failed start."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from aiohttp import web

from fulmen.infra.settings import FulmenSettings
from fulmen.producers.gateway import Gateway, GatewayStats
from fulmen.producers.otlp_gateway.settings import OtlpSection
from fulmen.schemas.errors import BrokerUnavailableError


class FakeProducer:
    """Connects when ``reachable`` is set; records start and stop in the shared ``events``."""

    def __init__(self, events: list[str], reachable: asyncio.Event) -> None:
        self.events = events
        self.reachable = reachable

    async def start(self) -> None:
        if not self.reachable.is_set():
            raise BrokerUnavailableError("no broker")
        self.events.append("producer started")

    async def stop(self) -> None:
        self.events.append("producer stopped")


class Echo(Gateway):
    name = "echo gateway"

    def __init__(self, producer: FakeProducer, *, background: bool, token: str | None = None, fail_setup=False):
        settings = FulmenSettings(kafka={"connect_timeout_s": 1})
        options = OtlpSection(port=0, bearer_token=token)
        super().__init__(settings, options, producer, topic="t", respond=_plain, connect_in_background=background)  # type: ignore[arg-type]
        self.stats = GatewayStats()
        self.events = producer.events
        self.fail_setup = fail_setup
        self.release = asyncio.Event()

    def _add_routes(self, app: web.Application) -> None:
        app.router.add_post("/slow", self.slow)

    async def _setup(self) -> None:
        self.events.append("setup")
        if self.fail_setup:
            raise RuntimeError("no model")

    async def _on_connected(self) -> None:
        self.events.append("connected")
        self.spawn(self._follow(), "follower")

    async def _teardown(self) -> None:
        self.events.append("teardown")

    async def _follow(self) -> None:
        await self.stopping.wait()
        self.events.append("follower ended")

    async def slow(self, request: web.Request) -> web.Response:
        self.stats.requests += 1
        await self.release.wait()
        self.events.append("request answered")
        return web.Response(text="done")


def _plain(request: web.Request, status: int, message: str, headers: dict[str, str]) -> web.Response:
    return web.Response(status=status, text=f"echo: {message}", headers=headers)


async def test_probes_and_the_stop_order_with_a_background_connection() -> None:
    events: list[str] = []
    reachable = asyncio.Event()
    gateway = Echo(FakeProducer(events, reachable), background=True, token="s3cret")
    await gateway.start()  # listens at once: the broker is not reachable yet
    root = f"http://127.0.0.1:{gateway.port}"
    async with httpx.AsyncClient(base_url=root) as client:
        assert (await client.get("/healthz")).status_code == 200
        ready = await client.get("/readyz")
        assert ready.status_code == 503 and ready.headers["Retry-After"] == "1"
        refused = await client.post("/slow")
        assert refused.status_code == 401 and refused.text.startswith("echo: ")  # the gateway's own error shape
        reachable.set()
        await asyncio.wait_for(gateway.connected.wait(), 10)  # the connector retried
        assert (await client.get("/readyz")).status_code == 200
        in_flight = asyncio.create_task(client.post("/slow", headers={"Authorization": "Bearer s3cret"}))
        while gateway.stats.requests == 0:
            await asyncio.sleep(0.01)
        stopping = asyncio.create_task(gateway.stop())
        await asyncio.sleep(0.2)
        gateway.release.set()
        assert (await in_flight).text == "done"  # drained, not cut off
        await stopping
    assert events[:3] == ["setup", "producer started", "connected"]
    # stopping: the request in flight is answered and the follower ends before the producer closes, then teardown
    assert set(events[3:5]) == {"request answered", "follower ended"}
    assert events[5:] == ["producer stopped", "teardown"]
    await gateway.stop()  # a second stop does nothing
    assert events[-1] == "teardown" and events.count("teardown") == 1


async def test_a_foreground_connection_fails_the_start_and_releases_what_was_set_up() -> None:
    events: list[str] = []
    gateway = Echo(FakeProducer(events, asyncio.Event()), background=False)
    with pytest.raises(BrokerUnavailableError):
        await gateway.start()
    assert events == ["setup", "producer stopped", "teardown"] and gateway.port is None


async def test_a_failed_setup_stops_before_listening() -> None:
    events: list[str] = []
    reachable = asyncio.Event()
    reachable.set()
    gateway = Echo(FakeProducer(events, reachable), background=False, fail_setup=True)
    with pytest.raises(RuntimeError, match="no model"):
        await gateway.start()
    assert events == ["setup", "producer stopped", "teardown"]


async def test_run_serves_until_the_event_is_set() -> None:
    events: list[str] = []
    reachable = asyncio.Event()
    reachable.set()
    gateway = Echo(FakeProducer(events, reachable), background=False)
    stop = asyncio.Event()
    running = asyncio.create_task(gateway.run(stop))
    while gateway.port is None:
        await asyncio.sleep(0.01)
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"http://127.0.0.1:{gateway.port}/readyz")).text == "ready\n"
    stop.set()
    await asyncio.wait_for(running, 10)
    assert events[-2:] == ["producer stopped", "teardown"]
