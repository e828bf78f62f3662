"""The processes the chaos bench starts, kills with SIGKILL and restarts: ``fulmen`` commands and the broker.

Each :class:`Proc` is one ``fulmen`` command (the console script next to this Python, as a user would run it) in
its own session, configured only by ``FULMEN_*`` variables, its output appended to ``<home>/logs/<name>.log``.
A :class:`Proc` placed on a host (``bench/cluster.py``: a network namespace, :mod:`fulmen.testing.hosts`) runs
through the host's launcher, and its :meth:`Proc.kill9` takes the whole host down (every process on it).
:class:`Broker` wraps :class:`fulmen.infra.kafka.cluster.LocalCluster` the same way (kill -9 of a JVM, restart on the
same data directory). :class:`Fleet` holds them all and stops every one of them (SIGTERM, then SIGKILL) on
:meth:`Fleet.stop`, also when the bench fails or is interrupted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from fulmen.infra.kafka.cluster import LocalCluster

__all__ = ["Broker", "Fleet", "Proc", "fulmen_command"]

log = logging.getLogger(__name__)


def fulmen_command() -> list[str]:
    """``.venv/bin/fulmen`` when it sits next to this interpreter, else ``python -m fulmen.cli.main``."""
    script = Path(sys.executable).with_name("fulmen")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "fulmen.cli.main"]


@dataclass
class Proc:
    """One ``fulmen`` process that can be started again: its arguments, environment and readiness URL."""

    name: str
    args: list[str]
    env: dict[str, str]
    log_dir: Path
    ready_url: str | None = None
    process: subprocess.Popen | None = None
    started_at: float = 0.0  # wall clock of the last (re)start
    exits: list[int] = field(default_factory=list)  # exit codes seen that the bench did not cause
    host: Any = None  # a fulmen.testing.hosts.Host it runs on (None: this machine's own network)
    program: list[str] = field(default_factory=lambda: fulmen_command())  # what runs ``args`` (torchrun's, say)

    def start(self) -> float:
        """Spawn the command; the wall-clock time it was spawned."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{self.name}.log", "ab") as out:
            out.write(f"\n=== chaos: start {self.name} at {time.time():.3f}\n".encode())
            out.flush()
            self.started_at = time.time()
            self.process = subprocess.Popen(
                [*(self.host.launcher if self.host is not None else ()), *self.program, *self.args],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        if self.host is not None:
            self.host.processes.append(self.process)  # reaped by the host's kill
        log.info("started %s (pid %d)", self.name, self.process.pid)
        return self.started_at

    def wait_ready(self, timeout_s: float) -> None:
        """Until ``ready_url`` answers 200; RuntimeError with the log's tail if the process exits or times out."""
        deadline = time.monotonic() + timeout_s
        while self.ready_url is not None and time.monotonic() < deadline:
            if not self.alive:
                raise RuntimeError(f"{self.name} exited at start:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.ready_url, timeout=1.0).status_code == 200:
                    return
            time.sleep(0.2)
        if self.ready_url is not None:
            raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f}s:\n{self.tail()}")

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill9(self) -> int:
        """SIGKILL the process (its pid only, as a crash would); the pid. On a host: every process of the host
        (the machine lost), and the pid of this one."""
        if self.process is None:
            raise RuntimeError(f"{self.name} was never started")
        pid = self.process.pid
        if self.host is not None:
            killed = self.host.kill()
            log.info("killed host %s (%d processes, %s among them) with SIGKILL", self.host.name, killed, self.name)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.process.wait()
        log.info("killed %s (pid %d) with SIGKILL", self.name, pid)
        return pid

    def reap(self) -> int | None:
        """The exit code if the process ended on its own since the last check (recorded in ``exits``)."""
        if self.process is None or self.process.poll() is None:
            return None
        code = self.process.returncode
        self.exits.append(code)
        self.process = None
        return code

    def stop(self, grace_s: float) -> None:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL."""
        if not self.alive or self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0fs; killing it", self.name, grace_s)
            self.process.kill()
            self.process.wait()
        self.process = None  # stopped by the bench: not an exit to report

    def tail(self, chars: int = 3000) -> str:
        path = self.log_dir / f"{self.name}.log"
        return path.read_text(errors="replace")[-chars:] if path.is_file() else ""


class Broker:
    """The local Kafka: started, SIGKILLed and restarted on the same data directory. One node: its JVM; a
    cluster: the node that leads the controller quorum (the other nodes keep running, as in a real outage)."""

    name = "broker"

    def __init__(self, kafka: LocalCluster) -> None:
        self.kafka = kafka
        self.started_at = 0.0
        self.exits: list[int] = []
        self.killed_node: int | None = None

    def start(self) -> float:
        """Start what does not run (after a kill: the killed node)."""
        self.started_at = time.time()
        self.kafka.start()
        return self.started_at

    @property
    def alive(self) -> bool:
        return self.kafka.status().running

    def kill9(self) -> int:
        node = self.kafka.quorum_leader() if len(self.kafka.nodes) > 1 else None
        self.killed_node = node if node is not None else self.kafka.nodes[0].node_id
        return self.kafka.kill(self.killed_node)

    def stop(self, grace_s: float) -> None:
        with contextlib.suppress(Exception):
            self.kafka.stop(grace_s)


class Fleet:
    """Every started process by name; stopped in reverse start order (the broker last)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.procs: dict[str, Proc] = {}

    def add(self, proc: Proc) -> Proc:
        self.procs[proc.name] = proc
        return proc

    def stop(self, grace_s: float = 30.0) -> None:
        for proc in reversed(list(self.procs.values())):
            try:
                proc.stop(grace_s)
            except Exception:  # keep stopping the others
                log.exception("could not stop %s", proc.name)
        self.broker.stop(grace_s)
