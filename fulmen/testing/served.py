"""Services run on an event loop of their own thread, for synchronous tests: ``with Served(start, stop):``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from fulmen.infra.store import ReadEndpoint, Store


class Served:
    """Runs ``start()`` on a private loop on entry and ``stop()`` on exit (both coroutine functions)."""

    def __init__(self, start: Callable[[], Coroutine[Any, Any, Any]], stop: Callable[[], Coroutine[Any, Any, Any]]):
        self._start, self._stop = start, stop
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class ServedEndpoint(Served):
    """The store's read endpoint on a free loopback port; ``url`` once entered."""

    def __init__(self, store: Store, token: str | None = None) -> None:
        self.endpoint = ReadEndpoint(store, "127.0.0.1", 0, token=token)
        super().__init__(self.endpoint.start, self.endpoint.stop)

    def __enter__(self) -> ServedEndpoint:
        super().__enter__()
        self.url = f"http://127.0.0.1:{self.endpoint.port}"
        return self
