"""One ``llama-server`` child process: started on a free loopback port, watched, stopped, never left behind.

:meth:`LlamaServer.start` runs the binary with the arguments it is given plus ``--host 127.0.0.1 --port <free>``,
reads its log lines (stderr and stdout) into the gateway's log at DEBUG, keeping the last ones for the error
message when it dies, and returns once ``GET /health`` answers 200 (the model is loaded);
:class:`ServerStartError` when it exits first or takes longer than the timeout.
:meth:`LlamaServer.stop` sends SIGTERM, then SIGKILL after a grace period.

No orphans: on Linux the child asks the kernel for SIGKILL when the thread that started it ends
(``PR_SET_PDEATHSIG``: the event loop's thread, which lives as long as the gateway), so a gateway killed with
SIGKILL takes its servers with it; an ``atexit`` hook stops any still running when the interpreter exits normally.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from fulmen.infra.processes import free_port
from fulmen.schemas.errors import FulmenError

__all__ = ["LlamaServer", "ServerStartError"]

log = logging.getLogger(__name__)

_TAIL_LINES = 30  # log lines kept for the error message of a server that died
_STOP_GRACE_S = 5.0
_HEALTH_POLL_S = 0.05
_BIND_ATTEMPTS = 3
_LINE_LIMIT = 1 << 20  # a longer log line is read in pieces
_LIVE: weakref.WeakSet[LlamaServer] = weakref.WeakSet()  # stopped at interpreter exit if still running


class ServerStartError(FulmenError):
    """llama-server exited, or did not load the model in time; the message ends with its last log lines."""


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class LlamaServer:
    """One child process serving one GGUF file (see the module docstring)."""

    def __init__(
        self,
        binary: Path,
        model: Path,
        arguments: Sequence[str],
        label: str,
        environment: Mapping[str, str] | None = None,
    ) -> None:
        self.binary = binary
        self.model = model
        self.arguments = list(arguments)
        self.label = label
        self.environment = dict(environment or {})  # added to the gateway's environment for the child
        self.port: int | None = None
        self.process: asyncio.subprocess.Process | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._reader: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def exit_reason(self) -> str:
        """Why the process is not serving, with its last log lines (for error messages)."""
        code = self.process.returncode if self.process is not None else None
        lines = "\n".join(self.tail)
        return f"llama-server {self.label} exited with {code}" + (f"; its last lines:\n{lines}" if lines else "")

    async def start(self, timeout_s: float) -> None:
        """Run the server and wait until it serves; :class:`ServerStartError` (the server stopped) if it does not.
        A port taken between choosing it and binding it is chosen again."""
        for attempt in range(_BIND_ATTEMPTS):
            try:
                await self._start_once(timeout_s)
                return
            except ServerStartError as exc:
                if "couldn't bind" not in exc.message or attempt == _BIND_ATTEMPTS - 1:
                    raise
                log.debug("llama-server %s: port %s was taken; another", self.label, self.port)

    async def _start_once(self, timeout_s: float) -> None:
        self.tail.clear()
        self.port = free_port()
        command = [
            str(self.binary),
            "-m",
            str(self.model),
            *self.arguments,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        log.debug("starting %s", " ".join(command))
        started = time.perf_counter()
        self.process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            limit=_LINE_LIMIT,
            env={**os.environ, **self.environment},
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        _LIVE.add(self)
        self._reader = asyncio.create_task(self._read_log(), name=f"llama-server-log-{self.label}")
        try:
            await self._wait_healthy(timeout_s)
        except BaseException:
            await self.stop()
            raise
        log.info(
            "llama-server %s serves %s on port %d (pid %d; up in %.2f s)",
            self.label,
            self.model.name,
            self.port,
            self.process.pid,
            time.perf_counter() - started,
        )

    async def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if not self.alive:
                    await self._drain_log()
                    raise ServerStartError(self.exit_reason())
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    lines = "\n".join(self.tail)
                    raise ServerStartError(
                        f"llama-server {self.label} did not load {self.model} within "
                        f"{timeout_s:.0f} s; its last lines:\n{lines}"
                    )
                await asyncio.sleep(_HEALTH_POLL_S)

    async def _read_log(self) -> None:
        """Every line the server writes, into the log at DEBUG (the pipe must be read or the server blocks)."""
        stream = self.process.stdout if self.process is not None else None
        if stream is None:
            return
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line longer than the stream's limit: take what is there
                line = await stream.read(_LINE_LIMIT)
            if not line:
                return
            text = line.decode("utf-8", "replace").rstrip()
            self.tail.append(text)
            log.debug("llama-server %s: %s", self.label, text)

    async def _drain_log(self) -> None:
        if self._reader is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._reader), 1.0)

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after a grace period; returns once the process is gone."""
        process = self.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                await asyncio.wait_for(process.wait(), _STOP_GRACE_S)
            except TimeoutError:
                log.warning("llama-server %s did not stop within %.0f s; killing it", self.label, _STOP_GRACE_S)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        _LIVE.discard(self)
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    def kill_now(self) -> None:
        """SIGKILL without waiting (interpreter exit)."""
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.kill_now()
