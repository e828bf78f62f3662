"""``fulmen up`` / ``down`` / ``status``: the local stack for an agent of one's own, supervised.

Lifecycle of :func:`supervise` (``fulmen up``; ``--detach`` runs the same in a daemon process):

1. refuse when a stack already runs (``$FULMEN_HOME/stack/up.pid`` names a live process; a stale file is
   removed), write ``up.pid``;
2. Kafka (``ensure_kafka``: the local broker unless ``FULMEN_KAFKA_BOOTSTRAP``; stopped at the end if started
   here), then :func:`fulmen.infra.stack.core_services` (``fulmen consume``, the OTLP gateway, the LLM gateway)
   and the dashboard when ``fulmen dashboard`` exists, each waited for until ready, on the ports their own
   settings name (``FULMEN_CLICKHOUSE_READ_PORT``, ``FULMEN_OTLP_PORT``, ``FULMEN_LLM_PORT``,
   ``FULMEN_DASHBOARD_PORT``); logs in ``stack/logs/<name>.log``, pids in ``stack/<name>.pid`` and everything
   ``fulmen status`` shows in ``stack/state.json``;
3. the lines an agent needs (:func:`ready_lines`), then a watch: a service that exits is reported with its
   log's tail and restarted, at most ``max_restarts`` times within ``window_s`` seconds
   (:class:`fulmen.infra.processes.RestartPolicy`); one more and the whole stack is stopped (exit code 1);
4. on SIGINT / SIGTERM (``fulmen down`` sends SIGTERM), or when it failed: every service stopped in reverse
   order, the Kafka it started stopped, the pid files and the state removed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from fulmen.cli.activity import activity
from fulmen.infra.kafka.local import process_alive
from fulmen.infra.processes import FULMEN, RestartPolicy, Services, ServiceSpec
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.stack import StackPorts, core_services, dashboard_available, dashboard_spec
from fulmen.schemas.errors import FulmenError

__all__ = ["StackOptions", "detach", "down", "ready_lines", "status_rows", "supervise"]

Say = Callable[[str], None]


@dataclass(frozen=True)
class StackOptions:
    """What ``fulmen up`` serves and how it restarts what dies."""

    model: str = "tiny"
    backend: str | None = None  # FULMEN_LLM_BACKEND for the LLM gateway; None: its own setting
    max_restarts: int = 3
    window_s: float = 60.0

    def args(self) -> list[str]:
        """The ``fulmen up`` options that give these options (for the daemon)."""
        backend = ["--backend", self.backend] if self.backend else []
        restarts = ["--max-restarts", str(self.max_restarts), "--window", str(self.window_s)]
        return ["--model", self.model, *backend, *restarts]


class _Stop(Exception):
    """Raised by the SIGINT / SIGTERM handler: stop the stack now (also while a service is being waited for)."""


def stack_dir(settings: FulmenSettings) -> Path:
    return settings.home / "stack"


def supervise(settings: FulmenSettings, ports: StackPorts, options: StackOptions, say: Say) -> int:
    """Run the stack until a signal or a service past its restarts (module docstring); the exit code."""
    from fulmen.infra.services import ensure_kafka

    home = stack_dir(settings)
    _claim(home)
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    state: dict[str, Any] = {
        "pid": os.getpid(),
        "started_at": time.time(),
        "ready": False,
        "services": [],
        "agent": ports.agent_settings(),
        "model": options.model,
    }
    ready, services = None, None
    try:
        say("starting Kafka (the first run downloads its jars) and the topics")
        ready = ensure_kafka(settings)
        state["kafka"] = {
            "bootstrap": ready.bootstrap,
            "started": ready.started is not None,
            "data_dir": str(settings.broker_data_dir),
        }
        _write_state(home, state)
        base_env = {k: v for k, v in os.environ.items() if k.startswith("FULMEN_")}
        base_env |= {"FULMEN_KAFKA_BOOTSTRAP": ready.bootstrap, "FULMEN_HOME": str(settings.home)}
        services = Services(home / "logs", base_env)
        for spec in _specs(ports, options, say, embedded=settings.clickhouse.url is None):
            say(f"starting {spec.name}")
            services.start(spec)
            _record(home, state, services, spec)
        state["ready"] = True
        _write_state(home, state)
        for line in ready_lines(state):
            say(line)
        return _watch(home, state, services, RestartPolicy(options.max_restarts, options.window_s), say)
    except _Stop:
        say("stopping (signal received)")
        return 0
    finally:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop short
        if services is not None:
            services.stop()
        if ready is not None and ready.started is not None:
            say("stopping the local Kafka this stack started")
            ready.started.stop()
        _clear(home)
        say("stack stopped")
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(signal.Signals(signum).name)


def _specs(ports: StackPorts, options: StackOptions, say: Say, *, embedded: bool) -> list[ServiceSpec]:
    llm_env = {"FULMEN_LLM_BACKEND": options.backend} if options.backend else {}
    specs = core_services(ports, model=options.model, llm_env=llm_env, embedded=embedded)
    if dashboard_available():
        specs.append(dashboard_spec(ports))
    else:
        say("dashboard: not installed here (no `fulmen dashboard` command): skipped")
    return [ServiceSpec(s.name, s.args, s.env, s.ready_url, ready_timeout_s=600.0) for s in specs]


def _watch(home: Path, state: dict[str, Any], services: Services, policy: RestartPolicy, say: Say) -> int:
    """Restart what exits, within the policy; 1 when a service exited once too often (the stack then stops)."""
    while True:
        for spec, code in services.exited():
            say(f"{spec.name} exited with {code}; the end of its log ({home / 'logs' / (spec.name + '.log')}):")
            say(services.tail(spec.name, 1500))
            if not policy.allow(spec.name, time.monotonic()):
                say(
                    f"{spec.name} exited {policy.max_restarts + 1} times within {policy.window_s:.0f}s: "
                    "stopping the stack"
                )
                state["failed"] = spec.name
                _write_state(home, state)
                return 1
            say(
                f"restarting {spec.name} (restart {policy.recent(spec.name)} of at most {policy.max_restarts} "
                f"within {policy.window_s:.0f}s)"
            )
            try:
                services.restart(spec.name)
            except FulmenError as exc:  # it exited or hung at start: counted again at the next look
                say(f"{spec.name} did not come back: {exc}")
            else:
                say(f"{spec.name} restarted (pid {services.pids()[spec.name]})")
            _record(home, state, services, spec, restarted=True)
        time.sleep(0.5)


# --- the stack directory -------------------------------------------------------------------------------------
def _claim(home: Path) -> None:
    pid = _read_pid(home / "up.pid")
    if pid is not None and process_alive(pid):
        raise FulmenError(f"a stack already runs (pid {pid}, {home}): `fulmen status` shows it, `fulmen down` stops it")
    if pid is not None:
        _clear(home)  # stale: its process is gone
    home.mkdir(parents=True, exist_ok=True)
    _write(home / "up.pid", str(os.getpid()))


def _record(
    home: Path, state: dict[str, Any], services: Services, spec: ServiceSpec, *, restarted: bool = False
) -> None:
    pid = services.pids().get(spec.name)
    entries = {entry["name"]: entry for entry in state["services"]}
    entry = entries.get(spec.name) or {
        "name": spec.name,
        "restarts": 0,
        "url": _public_url(spec),
        "metrics_url": _metrics_url(spec),
        "ready_url": spec.ready_url,
        "log": str(home / "logs" / f"{spec.name}.log"),
    }
    entry |= {"pid": pid, "started_at": time.time(), "restarts": entry["restarts"] + int(restarted)}
    if spec.name not in entries:
        state["services"].append(entry)
    if pid is not None:
        _write(home / f"{spec.name}.pid", str(pid))
    _write_state(home, state)


def _public_url(spec: ServiceSpec) -> str | None:
    """What a user opens: the LLM gateway's /v1, the others' root (from the readiness URL)."""
    if spec.ready_url is None:
        return None
    root = spec.ready_url.rsplit("/", 1)[0]
    return f"{root}/v1" if spec.name == "llm-gateway" else root


def _metrics_url(spec: ServiceSpec) -> str | None:
    """Where its Prometheus metrics are: ``/metrics`` beside its readiness probe (the gateways, the consumers' read
    endpoint); None for a service without (the dashboard)."""
    if spec.ready_url is None or spec.name == "dashboard":
        return None
    return f"{spec.ready_url.rsplit('/', 1)[0]}/metrics"


def _write_state(home: Path, state: dict[str, Any]) -> None:
    _write(home / "state.json", json.dumps(state, indent=2))


def _write(path: Path, text: str) -> None:
    """Atomically (a reader never sees half a file)."""
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(text)
    os.replace(staging, path)


def read_state(settings: FulmenSettings) -> dict[str, Any] | None:
    path = stack_dir(settings) / "state.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _clear(home: Path) -> None:
    for path in [home / "up.pid", home / "state.json", *home.glob("*.pid")]:
        path.unlink(missing_ok=True)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _is_fulmen(pid: int) -> bool:
    """Whether ``pid`` is a ``fulmen`` process (a pid file's number may have been reused by another process)."""
    try:
        return b"fulmen" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return process_alive(pid)


# --- what users see ------------------------------------------------------------------------------------------
def ready_lines(state: dict[str, Any]) -> list[str]:
    """The lines ``fulmen up`` prints once every service is ready (the same with ``--detach``)."""
    agent = state["agent"]
    lines = ["stack ready:"]
    for entry in state["services"]:
        lines.append(f"  {entry['name']:<13} pid {entry['pid']:<8} {entry['url'] or '-'}")
    lines += [
        "point your agent at it (the OpenTelemetry SDK's OTLP/HTTP exporter, and the OpenAI client's base_url):",
        f"  export OTEL_EXPORTER_OTLP_ENDPOINT={agent['OTEL_EXPORTER_OTLP_ENDPOINT']}",
        f"  export OPENAI_BASE_URL={agent['OPENAI_BASE_URL']}",
    ]
    dashboard = next((e["url"] for e in state["services"] if e["name"] == "dashboard"), None)
    lines.append(f"dashboard: {dashboard}" if dashboard else "dashboard: not running (not installed)")
    scraped = [e["metrics_url"] for e in state["services"] if e.get("metrics_url")]
    if scraped:
        lines.append(f"Prometheus metrics (scrape these; docs/operating.md): {' '.join(scraped)}")
    lines.append('query the store: fulmen sql "SELECT ..."; stop: Ctrl-C, or `fulmen down` when detached')
    return lines


def detach(settings: FulmenSettings, options: StackOptions, say: Say, timeout_s: float = 1800.0) -> int:
    """Start ``fulmen up`` as a daemon (its output in ``stack/up.log``), return once it is ready (0) or failed."""
    home = stack_dir(settings)
    pid = _read_pid(home / "up.pid")
    if pid is not None and process_alive(pid):
        raise FulmenError(f"a stack already runs (pid {pid}): `fulmen status` shows it, `fulmen down` stops it")
    home.mkdir(parents=True, exist_ok=True)
    (home / "state.json").unlink(missing_ok=True)
    log_path = home / "up.log"
    with open(log_path, "ab") as out:
        daemon = subprocess.Popen(
            [*FULMEN, "up", *options.args()],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = read_state(settings)
        if state is not None and state.get("ready") and state.get("pid") == daemon.pid:
            for line in ready_lines(state):
                say(line)
            say(f"running in the background (pid {daemon.pid}); its output: {log_path}")
            return 0
        if daemon.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise FulmenError(f"the stack did not start (exit {daemon.returncode}); the end of {log_path}:\n{tail}")
        time.sleep(0.3)
    daemon.terminate()
    raise FulmenError(f"the stack was not ready after {timeout_s:.0f}s; see {log_path}")


def down(settings: FulmenSettings, say: Say, grace_s: float = 120.0) -> int:
    """Stop a detached stack (SIGTERM to its supervisor, which stops the rest), wait, clean up; the exit code."""
    home = stack_dir(settings)
    pid = _read_pid(home / "up.pid")
    state = read_state(settings) or {}
    if pid is None:
        say(f"no stack runs (no {home / 'up.pid'})")
        _stop_local_kafka(settings, say)
        return 0
    if process_alive(pid) and _is_fulmen(pid):
        say(f"stopping the stack (pid {pid})")
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if process_alive(pid):
            say(f"the supervisor did not stop within {grace_s:.0f}s: killing it")
            os.kill(pid, signal.SIGKILL)
    else:
        say(f"the stack's supervisor (pid {pid}) is gone: cleaning up after it")
    _kill_leftovers(home, state, say)
    _clear(home)
    say("stack stopped")
    return 0


def _stop_local_kafka(settings: FulmenSettings, say: Say) -> None:
    """The local Kafka a command other than ``fulmen up`` started (``fulmen submit``, ``fulmen runner``,
    ``fulmen kafka up`` leave it running for the next commands): ``fulmen down`` stops it too."""
    if not settings.local_kafka:
        return
    from fulmen.infra.kafka.cluster import stop_all

    stopped = stop_all(settings.broker_data_dir)
    if stopped:
        say("stopped the local Kafka (" + ", ".join(s.bootstrap for s in stopped) + ")")


def _kill_leftovers(home: Path, state: dict[str, Any], say: Say) -> None:
    """What a supervisor killed by SIGKILL leaves: services (they get SIGTERM from the kernel, but may still be
    stopping) and the local Kafka it started."""
    for path in home.glob("*.pid"):
        pid = _read_pid(path)
        if path.name == "up.pid" or pid is None or not process_alive(pid) or not _is_fulmen(pid):
            continue
        say(f"stopping {path.stem} (pid {pid}), left behind")
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if process_alive(pid):
            os.kill(pid, signal.SIGKILL)
    kafka = state.get("kafka") or {}
    if kafka.get("started"):
        from fulmen.infra.kafka.cluster import stop_all

        if stop_all(Path(kafka["data_dir"])):
            say("stopped the local Kafka the stack had started")


def status_rows(settings: FulmenSettings) -> tuple[list[tuple[str, str, str, str, str, str]], int]:
    """(service, pid, state, URL, uptime, activity) rows and the exit code: 0 all up, 1 something down, 3 no stack.
    The supervisor's URL is '-' (its directory is :func:`stack_dir`, which ``fulmen status`` prints under the table);
    activity is what a service's metrics say it did (:func:`fulmen.cli.activity.activity`)."""
    home = stack_dir(settings)
    pid = _read_pid(home / "up.pid")
    state = read_state(settings)
    if pid is None or state is None:
        return [], 3
    now = time.time()
    alive = process_alive(pid)
    rows = [("supervisor", str(pid), "up" if alive else "down (stale pid file)", "-", _uptime(now, state), "-")]
    kafka = state.get("kafka")
    if kafka:
        rows.append(("kafka", "-", "up" if _answers(kafka["bootstrap"]) else "down", kafka["bootstrap"], "-", "-"))
    for entry in state["services"]:
        restarts = f" ({entry['restarts']} restarts)" if entry["restarts"] else ""
        service_state = _service_state(entry)
        metrics_url = entry.get("metrics_url") if service_state == "up" else None
        rows.append(
            (
                entry["name"],
                str(entry["pid"]),
                service_state,
                entry["url"] or "-",
                _uptime(now, entry) + restarts,
                activity(entry["name"], metrics_url, now),
            )
        )
    if not alive:
        return rows, 3
    return rows, 0 if all(row[2] == "up" for row in rows) and state.get("ready") else 1


def _service_state(entry: dict[str, Any]) -> str:
    if entry["pid"] is None or not process_alive(entry["pid"]):
        return "down"
    if entry["ready_url"] is None:
        return "up"
    try:
        return "up" if httpx.get(entry["ready_url"], timeout=2.0).status_code == 200 else "not ready"
    except httpx.HTTPError:
        return "not ready"


def _answers(bootstrap: str) -> bool:
    host, _, port = bootstrap.split(",")[0].rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2.0):
            return True
    except OSError:
        return False


def _uptime(now: float, entry: dict[str, Any]) -> str:
    seconds = int(now - entry["started_at"])
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"
