"""What every throughput bench shares: repetitions, their median and spread, and the load they ran under.

A bench measures one repetition as a dict of figures; :func:`summarise` turns the repetitions into the figures'
medians (the bench's headline keys), each figure's spread (``[min, max]``) and the load average before and after,
so a reader can tell a noisy machine from a real difference. Warm-up is the bench's own business (one repetition
run and thrown away, or a short burst): it says which in its docstring.

Where the time goes, by process: :class:`ProcessCounters` takes each process's CPU time, context switches (from
``/proc``, every thread) and system calls (``perf stat`` attached to it, where perf may trace it) over a window and
divides them by the units of work done in it (a span, a rollout, a call). :class:`MemorySampler` tells a process's
peak resident memory apart: anonymous (heap, the engine's working memory) and file-backed (mapped code and files,
clean pages the kernel can drop and read back), which ``VmHWM`` lumps together.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
from argparse import ArgumentParser
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["MemorySampler", "ProcessCounters", "cpu_seconds", "load_average", "resident_mb", "summarise"]


def add_env_option(parser: ArgumentParser) -> None:
    """``--env FULMEN_X=VALUE`` (repeatable): a setting for the Fulmen processes a bench starts, so a lever's before
    and after run in one sitting; :func:`env_settings` turns the values into environment entries."""
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="FULMEN_X=VALUE",
        help="a setting for Fulmen's processes (repeatable; a lever's before and after in one sitting)",
    )


def env_settings(values: Sequence[str]) -> dict[str, str]:
    """``--env``'s values as environment entries; one without ``=`` is refused."""
    bad = [value for value in values if "=" not in value]
    if bad:
        raise SystemExit(f"--env takes FULMEN_X=VALUE, not {', '.join(bad)}")
    return dict(value.split("=", 1) for value in values)


def started_broker(prefix: str) -> tuple[Path, Any]:
    """A fresh home directory (``/tmp/<prefix>...``) and a local Kafka started in it on free ports; stop it when
    done."""
    from fulmen.infra.kafka.local import LocalKafka
    from fulmen.infra.processes import free_port
    from fulmen.infra.settings import BrokerSettings

    home = Path(tempfile.mkdtemp(prefix=prefix))
    broker = LocalKafka(BrokerSettings(port=free_port(), controller_port=free_port()), home / "kafka")
    broker.start()
    return home, broker


def fulmen_env(bootstrap: str, home: Path, lever: Sequence[str] = (), **settings: str) -> dict[str, str]:
    """The environment of the Fulmen processes a bench starts: this process's without any ``FULMEN_*``, then the
    bench's broker and home, warnings only, the source tree on ``PYTHONPATH``, ``settings`` (``FULMEN_X=...``) and
    last ``--env``'s values (``lever``), so a lever overrides what the bench sets."""
    return (
        {name: value for name, value in os.environ.items() if not name.startswith("FULMEN_")}
        | {
            "FULMEN_KAFKA_BOOTSTRAP": bootstrap,
            "FULMEN_HOME": str(home),
            "FULMEN_LOG_LEVEL": "WARNING",
            "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
        }
        | settings
        | env_settings(lever)
    )


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages (2 cores: above 2 means something else competed)."""
    return [round(value, 2) for value in os.getloadavg()]


def summarise(
    runs: Sequence[dict[str, Any]], load_before: list[float], *, totals: Sequence[str] = ()
) -> dict[str, Any]:
    """Medians of the numeric figures of ``runs`` at the top level (sums for the keys in ``totals``: a span lost
    in one repetition is lost), with ``spread`` (min, max per figure), ``runs`` (each repetition as measured),
    ``repetitions`` and ``load_average`` (before, after)."""
    if not runs:
        raise ValueError("no repetitions to summarise")
    numeric = [key for key, value in runs[0].items() if isinstance(value, int | float) and not isinstance(value, bool)]
    summary: dict[str, Any] = {}
    spread: dict[str, list[float]] = {}
    for key in numeric:
        values = [run[key] for run in runs if isinstance(run.get(key), int | float)]
        summary[key] = sum(values) if key in totals else round(statistics.median(values), 4)
        spread[key] = [round(min(values), 4), round(max(values), 4)]
    summary["spread"] = spread
    summary["repetitions"] = len(runs)
    summary["runs"] = list(runs)
    summary["load_average"] = {"before": load_before, "after": load_average()}
    return summary


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (from /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def context_switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of a process so far, summed over its live threads: a voluntary
    one is a thread that waited (a poll, a lock, a read with nothing to read), an involuntary one a thread the
    kernel took off a core for another."""
    voluntary = involuntary = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0, 0
    for task in tasks:
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    voluntary += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    involuntary += int(line.split()[1])
        except OSError:
            continue  # the thread ended meanwhile
    return voluntary, involuntary


class ProcessCounters:
    """CPU, context switches and system calls of some processes over a window (from construction to
    :meth:`per`). System calls are counted by one ``perf stat -e raw_syscalls:sys_enter -p PID`` per process when
    perf is installed and allowed to trace it; otherwise their keys are absent."""

    def __init__(self, pids: dict[str, int], *, syscalls: bool = True) -> None:
        self.pids = pids
        self.cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
        self.switches = {name: context_switches(pid) for name, pid in pids.items()}
        self._perf: dict[str, subprocess.Popen[bytes]] = {}
        perf = shutil.which("perf") if syscalls else None
        self._dir = Path(tempfile.mkdtemp(prefix="fulmen-perf-")) if perf else Path()
        for name, pid in pids.items() if perf else ():
            command = [
                perf,
                "stat",
                "-x",
                ",",
                "-e",
                "raw_syscalls:sys_enter",
                "-p",
                str(pid),
                "-o",
                str(self._dir / f"{name}.csv"),
            ]
            self._perf[name] = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def per(self, units: float, unit: str) -> dict[str, float]:
        """Stop counting; per ``unit`` of work and process: ``cpu_us_per_<unit>_<process>``,
        ``syscalls_per_<unit>_<process>``, ``ctx_switches_per_<unit>_<process>`` (voluntary + involuntary) and
        ``involuntary_ctx_switches_per_<unit>_<process>``."""
        units = max(units, 1)
        result: dict[str, float] = {}
        for name, pid in self.pids.items():
            voluntary, involuntary = context_switches(pid)
            before_voluntary, before_involuntary = self.switches[name]
            result[f"cpu_us_per_{unit}_{name}"] = round((cpu_seconds(pid) - self.cpu[name]) * 1e6 / units, 1)
            switched = voluntary - before_voluntary + involuntary - before_involuntary
            result[f"ctx_switches_per_{unit}_{name}"] = round(switched / units, 3)
            result[f"involuntary_ctx_switches_per_{unit}_{name}"] = round((involuntary - before_involuntary) / units, 3)
        for name, process in self._perf.items():
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                continue
            count = _perf_count(self._dir / f"{name}.csv")
            if count is not None:
                result[f"syscalls_per_{unit}_{name}"] = round(count / units, 2)
        if self._perf:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._perf.clear()
        return result


def _perf_count(path: Path) -> int | None:
    """The count in ``perf stat -x ,`` output (None when perf could not count: not allowed, or the process ended)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(",")
        if len(fields) > 2 and fields[2].startswith("raw_syscalls:sys_enter"):
            return int(fields[0]) if fields[0].isdigit() else None
    return None


def resident_mb(pid: int) -> dict[str, float]:
    """A process's resident memory now, in MiB: ``anon``, ``file`` and ``shmem`` (``/proc/PID/status``; {} once it
    is gone)."""
    fields = {"RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    found = {}
    for line in lines:
        name, *values = line.split()
        if name in fields:
            found[fields[name]] = int(values[0]) / 1024
    return found


class MemorySampler:
    """Samples :func:`resident_mb` of ``pid`` every ``interval_s`` on a thread while in a ``with`` block; then
    :meth:`peaks` gives the peak anonymous memory, and the file-backed memory at the peak of the total."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.peak_anon = 0.0
        self.peak_total: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                return

    def sample(self) -> None:
        now = resident_mb(self.pid)
        if not now:
            return
        self.peak_anon = max(self.peak_anon, now.get("anon", 0.0))
        if sum(now.values()) > sum(self.peak_total.values()):
            self.peak_total = now

    def peaks(self) -> dict[str, float]:
        """``peak_anon_mb``; ``file_mb_at_peak`` and ``anon_mb_at_peak`` (the sample with the largest total)."""
        return {
            "peak_anon_mb": round(self.peak_anon, 1),
            "anon_mb_at_peak": round(self.peak_total.get("anon", 0.0), 1),
            "file_mb_at_peak": round(self.peak_total.get("file", 0.0), 1),
        }
