"""The process supervisor: ``fulmen`` services started as child processes, watched, restarted, stopped again.

Each service is the real ``fulmen`` command in its own process, configured only through ``FULMEN_*``
variables (the same way a user would run it), with its output appended to ``<log dir>/<name>.log``.
:class:`Services` starts them one by one, waits until each answers its readiness probe (an HTTP URL that must
answer 200), and stops all of them in reverse order on :meth:`Services.stop` (SIGTERM, then SIGKILL after
``grace_s``), also when its user fails or is interrupted (use it as a context manager). Users: the local
training run (:mod:`fulmen.algorithm.local`, hence the demo and the examples) and ``fulmen up``.

A service that exits is found by :meth:`Services.check` (raises) or :meth:`Services.exited` (returns them);
:meth:`Services.restart` starts it again in its place. :class:`RestartPolicy` decides whether another restart
is allowed (at most ``max_restarts`` of one service within ``window_s``); past that the caller stops the stack.
Children get SIGTERM when their parent dies, even by SIGKILL (Linux's ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

from fulmen.schemas.errors import FulmenError

__all__ = ["FULMEN", "RestartPolicy", "ServiceSpec", "Services", "free_port", "port_is_free"]

log = logging.getLogger(__name__)

FULMEN = [sys.executable, "-m", "fulmen.cli.main"]


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PICKS = 64  # random tries before asking the kernel for one
_pick = random.SystemRandom()  # not the random module's state, which tests and training seed alike in every process


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now, for a service started next to listen on.

    It is drawn at random from the 16,384 ports just below the kernel's ephemeral range. A port the kernel hands
    out itself (binding port 0) comes from that range, where the local end of any outgoing connection (a Kafka
    client's, an HTTP request's) may take it before the service binds it: CI once lost an LLM gateway's port so.
    Below the range only another listener can take it, and two drawing at once rarely draw the same."""
    low = _ephemeral_low()
    first = max(10_000, low - 16_384)  # well-known services (Kafka 9092, ClickHouse 8123, ...) live below 10,000
    if low - first >= 1_024:
        for _ in range(_PICKS):
            port = _pick.randrange(first, low)
            if port_is_free(host, port):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default (macOS's range starts at 49,152, so below this is outside it too)


def port_is_free(host: str, port: int) -> bool:
    """Whether a listener could bind ``port`` on ``host`` now (a port left in TIME_WAIT counts as free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


@dataclass(frozen=True)
class ServiceSpec:
    """One process: its name (and log file), ``fulmen`` arguments, extra environment, readiness URL (or None)."""

    name: str
    args: tuple[str, ...]
    env: dict[str, str]
    ready_url: str | None = None
    ready_timeout_s: float = 120.0


@dataclass
class RestartPolicy:
    """At most ``max_restarts`` restarts of one service within any ``window_s`` seconds (then: stop the stack).

    :meth:`allow` records a restart when it allows one; the clock is passed in (monotonic seconds), so the
    policy is a pure function of the times it was asked at."""

    max_restarts: int = 3
    window_s: float = 60.0
    _times: dict[str, deque[float]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0:
            raise FulmenError(f"a restart policy needs max_restarts >= 0 and window_s > 0, not {self}")

    def allow(self, name: str, now: float) -> bool:
        """True (and the restart counted) when ``name`` restarted fewer than ``max_restarts`` times in the last
        ``window_s`` seconds before ``now``."""
        times = self._times.setdefault(name, deque())
        while times and now - times[0] >= self.window_s:
            times.popleft()
        if len(times) >= self.max_restarts:
            return False
        times.append(now)
        return True

    def recent(self, name: str) -> int:
        """Restarts of ``name`` counted in the current window."""
        return len(self._times.get(name, ()))


class Services:
    """Started processes, stopped in reverse order; see the module docstring."""

    def __init__(self, log_dir: Path, base_env: dict[str, str], grace_s: float = 30.0) -> None:
        self.log_dir = log_dir
        self.base_env = base_env
        self.grace_s = grace_s
        self.running: list[tuple[ServiceSpec, subprocess.Popen]] = []

    def start(self, spec: ServiceSpec, *, index: int | None = None) -> None:
        """Start ``spec`` and wait until it is ready; FulmenError (with the log's tail) if it exits or times out.
        ``index``: its place in the stop order (default: last, so stopped first)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | self.base_env | spec.env
        with open(self.log_dir / f"{spec.name}.log", "ab") as out:
            process = subprocess.Popen(
                [*FULMEN, *spec.args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )  # fmt: skip  (Ctrl-C reaches only the parent)
        self.running.insert(len(self.running) if index is None else index, (spec, process))
        log.info("started %s (pid %d)", spec.name, process.pid)
        if spec.ready_url is not None:
            self._wait_ready(spec, process)

    def _wait_ready(self, spec: ServiceSpec, process: subprocess.Popen) -> None:
        deadline = time.monotonic() + spec.ready_timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise FulmenError(f"{spec.name} exited with {process.returncode} at start:\n{self.tail(spec.name)}")
            try:
                if httpx.get(spec.ready_url, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise FulmenError(f"{spec.name} was not ready after {spec.ready_timeout_s:.0f}s:\n{self.tail(spec.name)}")

    def check(self) -> None:
        """FulmenError when a started process has exited (a training run cannot go on without it)."""
        for spec, code in self.exited():
            raise FulmenError(f"{spec.name} exited with {code}:\n{self.tail(spec.name)}")

    def exited(self) -> list[tuple[ServiceSpec, int]]:
        """The started services whose process has exited, with its exit code (negative: killed by that signal)."""
        return [(spec, process.returncode) for spec, process in self.running if process.poll() is not None]

    def restart(self, name: str) -> None:
        """Start the service ``name`` again in its place (same spec, same log appended to), waiting until ready;
        the old process is stopped first if it still runs. FulmenError as :meth:`start`."""
        index = next((i for i, (spec, _) in enumerate(self.running) if spec.name == name), None)
        if index is None:
            raise FulmenError(f"no service {name!r} was started")
        spec, old = self.running.pop(index)
        if old.poll() is None:
            self._stop_one(spec, old)
        self.start(spec, index=index)

    def pids(self) -> dict[str, int]:
        """Each started service's current process id, by name."""
        return {spec.name: process.pid for spec, process in self.running}

    def tail(self, name: str, chars: int = 2000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.is_file() else ""

    def stop(self) -> None:
        """SIGTERM every process (newest first), wait up to ``grace_s`` each, SIGKILL what is left."""
        for spec, process in reversed(self.running):
            self._stop_one(spec, process)
        self.running.clear()

    def _stop_one(self, spec: ServiceSpec, process: subprocess.Popen) -> None:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=self.grace_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0fs; killing it", spec.name, self.grace_s)
            process.kill()
            process.wait()

    def __enter__(self) -> Services:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, get SIGTERM when the parent dies, even by SIGKILL (a demo killed by a
    timeout left its gateways, runner and consumers running)."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
