"""A real S3-compatible object store for tests and benches: SeaweedFS's ``weed`` (master, volume, filer and S3
gateway in one process), built once from its Go module into ``~/.cache/fulmen/seaweedfs/<version>/weed``.

No binary can be downloaded here (only the package registries answer), so :func:`build_weed` builds it with the
Go toolchain from the Go module proxy (:func:`fulmen.testing.gobuild.go_build`: SeaweedFS at :data:`VERSION`, with
the one ``replace`` its own go.mod carries). It takes minutes the first time and needs the Go toolchain.

:class:`SeaweedS3` runs ``weed server -s3`` on one address with its data in one directory, with one identity
(:data:`ACCESS_KEY`, :data:`SECRET_KEY`), and makes a bucket; :meth:`SeaweedS3.environment` is what a client
process needs to reach it (the ``AWS_*`` variables every S3 client reads).

    python -m fulmen.testing.seaweedfs          # build if needed, print the path
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

from fulmen.infra.processes import free_port
from fulmen.schemas.errors import ConfigurationError
from fulmen.testing.gobuild import GoServer, go_build

__all__ = ["ACCESS_KEY", "MODULE", "SECRET_KEY", "VERSION", "SeaweedS3", "build_weed", "cached_weed"]

log = logging.getLogger(__name__)

MODULE = "github.com/seaweedfs/seaweedfs"
VERSION = "v0.0.0-20261109003541-7506e5f91cd6"  # the newest the Go module proxy served on 2026-12-01
CACHE = Path.home() / ".cache" / "fulmen" / "seaweedfs"
ACCESS_KEY = "fulmen-test"
SECRET_KEY = "fulmen-test-secret"
REGION = "us-east-1"
_REPLACES = ("github.com/tyler-smith/go-bip39 => github.com/cosmos/go-bip39 v1.0.0",)  # as SeaweedFS's go.mod
_GO_VERSION = "1.26.6"  # SeaweedFS's go.mod's
_USUAL_PORTS = {
    "master.port": 9333,
    "master.port.grpc": 19333,
    "volume.port": 8080,
    "volume.port.grpc": 18080,
    "filer.port": 8888,
    "filer.port.grpc": 18888,
    "s3.port": 8333,
    "s3.port.grpc": 18333,
}


def cached_weed(cache: Path = CACHE) -> Path:
    return cache / VERSION.rsplit("-", 1)[-1] / "weed"


def build_weed(cache: Path = CACHE, timeout_s: float = 1800) -> Path:
    """The ``weed`` binary, built the first time (minutes). ConfigurationError without Go or when the build fails."""
    target = cached_weed(cache)
    return go_build(
        MODULE, VERSION, f"{MODULE}/weed", target, replaces=_REPLACES, go_version=_GO_VERSION, timeout_s=timeout_s
    )


class SeaweedS3(GoServer):
    """``weed server -s3`` on ``host`` with its data under ``data_dir`` (a context manager: started, stopped)."""

    def __init__(
        self,
        data_dir: Path,
        host: str = "127.0.0.1",
        *,
        bucket: str = "fulmen",
        weed: Path | None = None,
        launcher: tuple[str, ...] = (),
    ) -> None:
        self.data_dir, self.host, self.bucket = Path(data_dir), host, bucket
        self.weed = weed or build_weed()
        self.launcher = launcher  # e.g. ("ip", "netns", "exec", "<host>"): run it inside another network namespace
        # on another host (a namespace of its own) SeaweedFS's usual ports are free; here, any free ones
        self.ports = dict(_USUAL_PORTS) if launcher else {name: free_port(host) for name in _USUAL_PORTS}
        self.log = self.data_dir / "weed.log"

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.ports['s3.port']}"

    def environment(self) -> dict[str, str]:
        """The variables an S3 client reads to reach this store."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
        }

    def start(self, timeout_s: float = 60) -> SeaweedS3:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "s3.json"
        identity = {"name": "fulmen", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]}
        config.write_text(json.dumps({"identities": [{**identity, "actions": ["Admin", "Read", "Write", "List"]}]}))
        p = self.ports
        command = [
            *self.launcher,
            str(self.weed),
            "server",
            f"-dir={self.data_dir}",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            "-volume.max=0",  # as many volumes as the disk holds
            "-master.volumeSizeLimitMB=256",
            "-filer",
            "-s3",
            f"-s3.config={config}",
            "-s3.port.iceberg=0",  # its catalogs would take fixed ports (8181, 9101): two servers would collide
            "-s3.port.lance=0",
            *(f"-{name}={port}" for name, port in p.items()),  # every port chosen: several servers side by side
        ]
        self._spawn(command)
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        """Until the S3 port answers and the bucket is made (``weed shell``'s ``s3.bucket.create``), bounded."""
        deadline = time.monotonic() + timeout_s
        master = f"{self.host}:{self.ports['master.port']}.{self.ports['master.port.grpc']}"  # host:port.grpc
        create = f"s3.bucket.create -name {self.bucket}\n"
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise ConfigurationError(f"weed exited with {self.process.returncode}: {self.log_tail()}")
            if _accepts(self.host, self.ports["s3.port"]):
                shell = subprocess.run(
                    [*self.launcher, str(self.weed), "shell", f"-master={master}", "-connectTimeout=5s"],
                    input=create,
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=False,
                )
                if shell.returncode == 0 and "error" not in (shell.stdout + shell.stderr).lower():
                    return
            if time.monotonic() > deadline:
                self.stop()
                raise ConfigurationError(f"SeaweedFS did not start within {timeout_s:g}s: {self.log_tail()}")
            time.sleep(0.5)


def _accepts(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, port)) == 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(build_weed())
    sys.exit(0)
