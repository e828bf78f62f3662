"""`fulmen up/down/status` without services: stale pid files, nothing running, the printed lines."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fulmen.cli.stack import StackOptions, _claim, down, ready_lines, stack_dir, status_rows
from fulmen.infra import processes
from fulmen.infra.processes import free_port
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.stack import StackPorts
from fulmen.schemas.errors import FulmenError


def dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    return int(done.stdout)


def state(pid: int, service_pid: int) -> dict:
    ports = StackPorts(1, 2, 3, 4)
    service = {
        "name": "consume",
        "pid": service_pid,
        "url": "http://127.0.0.1:1",
        "ready_url": None,
        "started_at": time.time(),
        "restarts": 0,
        "log": "x",
    }
    return {
        "pid": pid,
        "started_at": time.time(),
        "ready": True,
        "services": [service],
        "agent": ports.agent_settings(),
    }


def write_stack(home: Path, up_pid: int, service_pid: int) -> Path:
    stack = home / "stack"
    stack.mkdir(parents=True)
    (stack / "up.pid").write_text(str(up_pid))
    (stack / "consume.pid").write_text(str(service_pid))
    (stack / "state.json").write_text(json.dumps(state(up_pid, service_pid)))
    return stack


def test_nothing_runs(tmp_path: Path) -> None:
    settings = FulmenSettings(home=tmp_path)
    assert status_rows(settings) == ([], 3)
    said: list[str] = []
    assert down(settings, said.append) == 0
    assert said == [f"no stack runs (no {stack_dir(settings) / 'up.pid'})"]


def test_a_stale_stack_is_reported_and_cleaned_up(tmp_path: Path) -> None:
    settings = FulmenSettings(home=tmp_path)
    stack = write_stack(tmp_path, dead_pid(), dead_pid())
    rows, code = status_rows(settings)
    assert code == 3
    assert rows[0][:3] == ("supervisor", rows[0][1], "down (stale pid file)")
    assert rows[1][0] == "consume" and rows[1][2] == "down"
    said: list[str] = []
    assert down(settings, said.append) == 0
    assert "is gone: cleaning up" in said[0] and said[-1] == "stack stopped"
    assert list(stack.glob("*.pid")) == [] and not (stack / "state.json").exists()


def test_a_service_down_under_a_live_supervisor_is_exit_code_1(tmp_path: Path) -> None:
    write_stack(tmp_path, os.getpid(), dead_pid())  # this process stands in for the supervisor
    rows, code = status_rows(FulmenSettings(home=tmp_path))
    assert code == 1 and [row[2] for row in rows] == ["up", "down"]


def test_up_refuses_a_second_stack_and_replaces_a_stale_one(tmp_path: Path) -> None:
    stack = write_stack(tmp_path, os.getpid(), os.getpid())
    with pytest.raises(FulmenError, match="a stack already runs"):
        _claim(stack)
    (stack / "up.pid").write_text(str(dead_pid()))
    _claim(stack)
    assert (stack / "up.pid").read_text() == str(os.getpid())
    assert not (stack / "consume.pid").exists() and not (stack / "state.json").exists()


def test_the_ready_lines_name_the_two_settings() -> None:
    lines = ready_lines(state(1, 2))
    assert "  export OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:2" in lines
    assert "  export OPENAI_BASE_URL=http://127.0.0.1:3/v1" in lines
    assert "dashboard: not running (not installed)" in lines


def test_the_daemon_gets_the_same_options() -> None:
    options = StackOptions(model="tiny", backend="openai", max_restarts=2, window_s=30.0)
    assert options.args() == ["--model", "tiny", "--backend", "openai", "--max-restarts", "2", "--window", "30.0"]


def test_a_service_past_its_restarts_stops_the_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The watch restarts a service that exits, reports each exit with its log's tail, and gives up (exit code 1,
    the state says which) once it exited more than ``max_restarts`` times within the window. The service is a
    stand-in command that fails at once."""
    from fulmen.cli.stack import _watch
    from fulmen.infra.processes import RestartPolicy, Services, ServiceSpec

    monkeypatch.setattr("fulmen.infra.processes.FULMEN", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"])
    said: list[str] = []
    home = tmp_path / "stack"
    home.mkdir()
    run_state = {"pid": os.getpid(), "started_at": time.time(), "ready": True, "services": []}
    with Services(home / "logs", {}, grace_s=5.0) as services:
        services.start(ServiceSpec("flaky", (), {}))
        assert _watch(home, run_state, services, RestartPolicy(max_restarts=2, window_s=600.0), said.append) == 1
    assert run_state["failed"] == "flaky"
    assert [line for line in said if line.startswith("restarting")] == [
        "restarting flaky (restart 1 of at most 2 within 600s)",
        "restarting flaky (restart 2 of at most 2 within 600s)",
    ]
    assert sum(line.startswith("flaky exited with 3") for line in said) == 3
    assert sum("boom" in line for line in said) == 3
    assert said[-1] == "flaky exited 3 times within 600s: stopping the stack"
    assert json.loads((home / "state.json").read_text())["services"][0]["restarts"] == 2


def test_a_free_port_is_drawn_below_the_range_outgoing_connections_take() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(max(10_000, low - 16_384) <= port < low for port in ports)
    assert len(ports) > 1  # drawn, not the same one each time
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))  # and nothing listens there


def test_a_free_port_without_the_kernels_range_is_the_kernels_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes, "_EPHEMERAL_RANGE", Path("/nonexistent/ip_local_port_range"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
    monkeypatch.setattr(processes, "_ephemeral_low", lambda: 10_500)  # too few ports below it: the kernel picks
    assert free_port() >= 1_024
