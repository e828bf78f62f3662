"""The fuzzer's two edges: a raw HTTP/1.1 exchange over a fresh loopback connection (any byte can be sent, and
a missing answer is told apart from a refused or reset connection), and a server run as its own process (so
its death and its resident memory are visible)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.fuzz_inputs import Case

__all__ = ["Answer", "Server", "send"]

log = logging.getLogger(__name__)

_KEEP = 4096  # bytes of an answer's body kept for the report


@dataclass
class Answer:
    status: int | None  # None: no status line came back
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str = ""  # "hang", "refused", "closed", "reset", ...
    seconds: float = 0.0

    @property
    def explained_5xx(self) -> bool:
        """A 503 with Retry-After says "busy, come back": the only 5xx a well-behaved server may answer here."""
        return self.status == 503 and "retry-after" in self.headers


async def send(port: int, case: Case, deadline_s: float) -> Answer:
    """Send ``case`` to 127.0.0.1:``port`` and read the answer, all within ``deadline_s``."""
    started = time.monotonic()
    try:
        answer = await asyncio.wait_for(_exchange(port, case.raw(port), case.method), deadline_s)
    except TimeoutError:
        answer = Answer(None, error="hang")
    except ConnectionRefusedError:
        answer = Answer(None, error="refused")
    except OSError as exc:
        answer = Answer(None, error=f"oserror:{type(exc).__name__}")
    answer.seconds = time.monotonic() - started
    return answer


async def _exchange(port: int, raw: bytes, method: str) -> Answer:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    try:
        write_error = ""
        try:
            writer.write(raw)
            await writer.drain()
        except (ConnectionResetError, BrokenPipeError) as exc:  # the server may answer early and close
            write_error = type(exc).__name__
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            return Answer(None, body=exc.partial[:_KEEP], error=f"closed{'/' + write_error if write_error else ''}")
        except (ConnectionResetError, asyncio.LimitOverrunError) as exc:
            return Answer(None, error=type(exc).__name__)
        status, headers = _parse_head(head)
        body = b"" if method == "HEAD" or status in (204, 304) else await _read_body(reader, headers)
        return Answer(status, headers, body)
    finally:
        writer.close()
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await writer.wait_closed()


def _parse_head(head: bytes) -> tuple[int | None, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    return status, headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    """Up to _KEEP bytes of the body; the rest is read and dropped (to the end of the stream or the length)."""
    kept = bytearray()
    length = headers.get("content-length")
    remaining = (
        int(length) if length and length.isdigit() and "chunked" not in headers.get("transfer-encoding", "") else None
    )
    while remaining is None or remaining > 0:
        chunk = await reader.read(65536 if remaining is None else min(65536, remaining))
        if not chunk:
            break
        if len(kept) < _KEEP:
            kept += chunk[: _KEEP - len(kept)]
        if remaining is not None:
            remaining -= len(chunk)
    return bytes(kept)


class Server:
    """One server process: started, probed for readiness, measured, stopped. ``ready`` returns True once it
    answers its good request."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path, port: int) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.port = port
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self, ready: Callable[[], bool], timeout_s: float) -> None:
        self.starts += 1
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(self.argv, env=self.env, stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.process.returncode} at start; see {self.log_path}")
            if ready():
                return
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} was not ready within {timeout_s:.0f}s; see {self.log_path}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int:
        return self.process.pid if self.process else 0

    def rss_mb(self) -> float:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("%s ignored SIGTERM for %.0fs: killing pid %d", self.name, grace_s, process.pid)
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=30)

    def kill(self) -> None:
        """SIGKILL at once (a wedged server, or one past the memory guard)."""
        process = self.process
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
