"""A slow, lossy link for tests and benches: Shopify's Toxiproxy server, built once from its Go module into
``~/.cache/fulmen/toxiproxy/<version>/toxiproxy-server`` (:func:`fulmen.testing.gobuild.go_build`).

This kernel has no ``netem`` qdisc, so faults on a link are put on it by a TCP proxy in user space: clients reach
a service through :meth:`Toxiproxy.proxy` (a listening address on the proxy's host that forwards to the
service), and :meth:`Toxiproxy.wan` makes that link a slow, lossy one: ``latency_ms`` (with ``jitter_ms``) on
each direction, and ``loss`` of the connections reset as they open (a user-space proxy cannot drop single
packets of a TCP stream; what loss costs a connection that lives, a retransmission, is within the jitter).

    python -m fulmen.testing.toxiproxy          # build if needed, print the path
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from fulmen.schemas.errors import ConfigurationError
from fulmen.testing.gobuild import GoServer, go_build

__all__ = ["VERSION", "Toxiproxy", "build_toxiproxy"]

log = logging.getLogger(__name__)

MODULE = "github.com/Shopify/toxiproxy/v2"
VERSION = "v2.5.0"
CACHE = Path.home() / ".cache" / "fulmen" / "toxiproxy"
API_PORT = 8474  # Toxiproxy's own default


def build_toxiproxy(cache: Path = CACHE, timeout_s: float = 1800) -> Path:
    """``toxiproxy-server``, built the first time (a minute or two); ConfigurationError without Go."""
    target = cache / VERSION / "toxiproxy-server"
    return go_build(MODULE, VERSION, f"{MODULE}/cmd/server", target, timeout_s=timeout_s)


class Toxiproxy(GoServer):
    """``toxiproxy-server`` listening on ``host`` (its API on :data:`API_PORT`), run through ``launcher`` (a
    host's ``ip netns exec``), its log ``<log_dir>/toxiproxy.log``; a context manager: started, stopped."""

    def __init__(self, host: str, log_dir: Path, *, launcher: tuple[str, ...] = (), binary: Path | None = None):
        self.host, self.log, self.launcher = host, Path(log_dir) / "toxiproxy.log", launcher
        self.binary = binary or build_toxiproxy()
        self.api = f"http://{host}:{API_PORT}"

    def start(self, timeout_s: float = 30) -> Toxiproxy:
        self._spawn([*self.launcher, str(self.binary), "-host", self.host, "-port", str(API_PORT)])
        deadline = time.monotonic() + timeout_s
        while not self._answers():
            if self.process is None or self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ConfigurationError(f"toxiproxy-server did not start: {self.log_tail()}")
            time.sleep(0.2)
        return self

    def proxy(self, name: str, port: int, upstream: str) -> str:
        """A link: ``host:port`` forwarding to ``upstream`` (``address:port``); the address clients use."""
        listen = f"{self.host}:{port}"
        self._post("/proxies", {"name": name, "listen": listen, "upstream": upstream, "enabled": True})
        return listen

    def wan(self, name: str, *, latency_ms: int = 50, jitter_ms: int = 5, loss: float = 0.01) -> None:
        """Make the link ``name`` a slow, lossy one (module docstring)."""
        for stream in ("upstream", "downstream"):
            latency = {"latency": latency_ms, "jitter": jitter_ms}
            self._toxic(name, f"latency_{stream}", "latency", stream, 1.0, latency)
        if loss > 0:
            self._toxic(name, "loss", "reset_peer", "upstream", loss, {"timeout": 0})

    def clear(self, name: str) -> None:
        """The link ``name`` without its toxics (a healthy one)."""
        for toxic in httpx.get(f"{self.api}/proxies/{name}/toxics", timeout=5).json():
            httpx.delete(f"{self.api}/proxies/{name}/toxics/{toxic['name']}", timeout=5).raise_for_status()

    def _toxic(self, proxy: str, name: str, kind: str, stream: str, toxicity: float, attributes: dict) -> None:
        body = {"name": name, "type": kind, "stream": stream, "toxicity": toxicity, "attributes": attributes}
        self._post(f"/proxies/{proxy}/toxics", body)

    def _post(self, path: str, body: dict[str, Any]) -> None:
        answer = httpx.post(f"{self.api}{path}", json=body, timeout=5)
        if answer.status_code >= 300:
            raise ConfigurationError(f"toxiproxy {path}: {answer.status_code} {answer.text}")

    def _answers(self) -> bool:
        try:
            return httpx.get(f"{self.api}/version", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(build_toxiproxy())
    sys.exit(0)
