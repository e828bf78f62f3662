"""A real Prometheus server for tests and benches, built once from its Go module into
``~/.cache/fulmen/prometheus/<version>/prometheus``.

No binary can be downloaded here (only the package registries answer), so :func:`build_prometheus` builds it with
the Go toolchain from the Go module proxy (:func:`fulmen.testing.gobuild.go_build`), with the ``remove_all_sd``
build tag: the service discovery of clouds and Kubernetes left out (static targets are all a test scrapes). It
takes minutes the first time and needs the Go toolchain.

:class:`PrometheusServer` scrapes the given targets every second, and :meth:`PrometheusServer.query` asks its HTTP
API an instant PromQL query.

    python -m fulmen.testing.prometheus          # build if needed, print the path
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from fulmen.infra.processes import free_port
from fulmen.schemas.errors import ConfigurationError
from fulmen.testing.gobuild import GoServer, go_build

__all__ = ["MODULE", "VERSION", "PrometheusServer", "build_prometheus", "cached_prometheus"]

MODULE = "github.com/prometheus/prometheus"
VERSION = "v0.316.0"  # Prometheus 3.16's Go module version; the newest the Go module proxy served on 2026-12-01
CACHE = Path.home() / ".cache" / "fulmen" / "prometheus"
_TAGS = ("remove_all_sd",)


def cached_prometheus(cache: Path = CACHE) -> Path:
    return cache / VERSION / "prometheus"


def build_prometheus(cache: Path = CACHE, timeout_s: float = 2400) -> Path:
    """The ``prometheus`` binary, built the first time (minutes). ConfigurationError without Go or when it fails."""
    return go_build(
        MODULE, VERSION, f"{MODULE}/cmd/prometheus", cached_prometheus(cache), tags=_TAGS, timeout_s=timeout_s
    )


class PrometheusServer(GoServer):
    """Prometheus scraping ``targets`` (``/metrics`` URLs) every second, its data under ``data_dir``, with the alerting
    rules of ``rule_files`` loaded (Prometheus refuses to start on a rule it cannot parse)."""

    def __init__(
        self,
        data_dir: Path,
        targets: Sequence[str],
        *,
        rule_files: Sequence[Path] = (),
        binary: Path | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.targets = list(targets)
        self.rule_files = [Path(f).resolve() for f in rule_files]
        self.binary = binary or build_prometheus()
        self.port = free_port()
        self.log = self.data_dir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60) -> PrometheusServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "prometheus.yml"
        config.write_text(_config(self.targets, self.rule_files))
        self._spawn(
            [
                str(self.binary),
                f"--config.file={config}",
                f"--storage.tsdb.path={self.data_dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ]
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise ConfigurationError(f"prometheus exited with {self.process.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ConfigurationError(f"prometheus not ready within {timeout_s:.0f}s: {self.log_tail()}")
            time.sleep(0.2)

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's result vector (``[{"metric": {...}, "value": [ts, "v"]}, ...]``)."""
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10.0)
        body = response.json()
        if response.status_code != 200 or body.get("status") != "success":
            raise ConfigurationError(f"prometheus refused {promql!r}: {body.get('error', response.text)}")
        return body["data"]["result"]

    def rules(self) -> list[dict[str, Any]]:
        """The rule groups loaded (``/api/v1/rules``)."""
        return httpx.get(f"{self.url}/api/v1/rules", timeout=10.0).json()["data"]["groups"]

    def targets_up(self) -> dict[str, str]:
        """Each scrape target's URL and health (``up``, ``down``, ``unknown``)."""
        body = httpx.get(f"{self.url}/api/v1/targets", timeout=10.0).json()
        return {target["scrapeUrl"]: target["health"] for target in body["data"]["activeTargets"]}


def _config(targets: Sequence[str], rule_files: Sequence[Path] = ()) -> str:
    """A scrape config: one job per target (its ``job`` label: the target's port), every second."""
    jobs = []
    for url in targets:
        parts = urlsplit(url)
        jobs.append(
            f"  - job_name: 'port-{parts.port}'\n"
            f"    metrics_path: '{parts.path or '/metrics'}'\n"
            f"    static_configs:\n      - targets: ['{parts.netloc}']\n"
        )
    rules = "".join(f"  - '{path}'\n" for path in rule_files)
    head = "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
    return head + (f"rule_files:\n{rules}" if rules else "") + "scrape_configs:\n" + "".join(jobs)


if __name__ == "__main__":
    try:
        print(build_prometheus())
    except ConfigurationError as exc:
        print(f"prometheus not built: {exc}", file=sys.stderr)
        sys.exit(1)
