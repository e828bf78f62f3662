"""The process supervisor's restart policy, and a restarted service taking its place in the stop order."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from fulmen.infra.processes import RestartPolicy, Services, ServiceSpec
from fulmen.schemas.errors import FulmenError


def test_the_policy_allows_max_restarts_within_the_window() -> None:
    policy = RestartPolicy(max_restarts=3, window_s=60.0)
    assert [policy.allow("llm", t) for t in (0.0, 1.0, 2.0)] == [True, True, True]
    assert policy.allow("llm", 59.0) is False  # a fourth within 60 s of the first
    assert policy.recent("llm") == 3


def test_the_window_slides_and_services_are_counted_apart() -> None:
    policy = RestartPolicy(max_restarts=2, window_s=10.0)
    assert policy.allow("a", 0.0) and policy.allow("a", 5.0)
    assert policy.allow("b", 6.0)  # another service has its own count
    assert not policy.allow("a", 9.9)
    assert policy.allow("a", 10.0)  # the restart at 0 s has left the window
    assert not policy.allow("a", 14.9)
    assert policy.allow("a", 15.0)
    assert policy.recent("a") == 2


def test_a_refused_restart_is_not_counted() -> None:
    policy = RestartPolicy(max_restarts=1, window_s=10.0)
    assert policy.allow("a", 0.0)
    assert not policy.allow("a", 1.0) and not policy.allow("a", 2.0)
    assert policy.allow("a", 10.0)


def test_zero_restarts_means_never() -> None:
    assert not RestartPolicy(max_restarts=0).allow("a", 0.0)


@pytest.mark.parametrize(("restarts", "window"), [(-1, 60.0), (3, 0.0)])
def test_a_nonsense_policy_is_refused(restarts: int, window: float) -> None:
    with pytest.raises(FulmenError, match="restart policy"):
        RestartPolicy(max_restarts=restarts, window_s=window)


def test_a_restarted_service_keeps_its_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Services run ``python -m fulmen.cli.main ARGS``: here a stand-in command that sleeps."""
    monkeypatch.setattr("fulmen.infra.processes.FULMEN", [sys.executable, "-c", "import time; time.sleep(60)"])
    with Services(tmp_path, {}, grace_s=5.0) as services:
        for name in ("first", "second", "third"):
            services.start(ServiceSpec(name, (), {}))
        before = services.pids()
        services.running[1][1].send_signal(signal.SIGKILL)
        services.running[1][1].wait()
        assert [(spec.name, code) for spec, code in services.exited()] == [("second", -signal.SIGKILL)]
        with pytest.raises(FulmenError, match="second exited with -9"):
            services.check()
        services.restart("second")
        assert services.exited() == []
        assert [spec.name for spec, _ in services.running] == ["first", "second", "third"]
        after = services.pids()
        assert after["second"] != before["second"] and after["first"] == before["first"]
        with pytest.raises(FulmenError, match="no service"):
            services.restart("fourth")
    assert services.running == []
