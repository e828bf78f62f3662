"""Servers the tests and benches run, built once from their Go modules (no binary can be downloaded here; the Go
module proxy answers): SeaweedFS's ``weed`` (:mod:`fulmen.testing.seaweedfs`), Toxiproxy's server
(:mod:`fulmen.testing.toxiproxy`), Prometheus (:mod:`fulmen.testing.prometheus`); :class:`GoServer` is what they
share: the process in its own session, its log, stopping it.

:func:`go_build` writes a throwaway module that requires the server's module at a pinned version (with the
``replace`` lines its own go.mod carries, which ``go install pkg@version`` refuses to honour), builds the command
into a temporary folder beside the cache and renames it into place when whole: a second call finds it and does
nothing, and two calls at once never see half a binary.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self

from fulmen.schemas.errors import ConfigurationError

__all__ = ["GoServer", "go_build"]

log = logging.getLogger(__name__)


def go_build(
    module: str,
    version: str,
    package: str,
    target: Path,
    *,
    replaces: Sequence[str] = (),
    tags: Sequence[str] = (),
    go_version: str = "1.22",
    timeout_s: float = 1800,
) -> Path:
    """The command ``package`` of ``module`` at ``version``, built at ``target`` the first time (minutes);
    ConfigurationError without the Go toolchain or when the build fails. ``tags``: Go build tags."""
    if target.is_file() and os.access(target, os.X_OK):
        return target
    go = shutil.which("go")
    if go is None:
        raise ConfigurationError(f"{target.name} (a server the tests use) is built with Go: install the Go toolchain")
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent.parent))
    try:
        header = f"module fulmen.local/{target.name}-build\n\ngo {go_version}\n\n"
        (work / "go.mod").write_text(header + "".join(f"replace {r}\n" for r in replaces))
        log.info("building %s %s with Go (once; minutes)", package, version)
        tagged = [f"-tags={','.join(tags)}"] if tags else []
        build = ["build", "-trimpath", "-ldflags=-s -w", *tagged, "-o", f"out/{target.name}", package]
        for command in (["get", f"{package}@{version}"], build):
            done = subprocess.run(
                [go, *command], cwd=work, capture_output=True, text=True, timeout=timeout_s, check=False
            )
            if done.returncode != 0:
                raise ConfigurationError(f"go {' '.join(command)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
        (work / "out").rename(target.parent)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


class GoServer:
    """A server process started in its own session with its output in ``log``; a context manager (``start``, then
    :meth:`stop`: SIGTERM to its session, SIGKILL after 3 s)."""

    log: Path
    process: subprocess.Popen[bytes] | None = None
    start: Callable[[], Self]  # each server's own: spawn (:meth:`_spawn`), then wait until it answers

    def _spawn(self, command: Sequence[str]) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                list(command), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(3)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 20) -> str:
        text = self.log.read_text(errors="replace") if self.log.is_file() else "(no log)"
        return "\n".join(text.splitlines()[-lines:])
