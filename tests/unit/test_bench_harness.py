"""The benches' per-process counters: CPU, context switches and (where perf may count them) system calls."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from bench.harness import MemorySampler, ProcessCounters, context_switches, resident_mb


def test_counters_divide_what_a_process_did_by_the_units_of_work() -> None:
    counters = ProcessCounters({"me": os.getpid()})
    for _ in range(20):
        time.sleep(0.001)  # each sleep is a voluntary context switch
    figures = counters.per(10, "call")
    assert figures["ctx_switches_per_call_me"] >= 1.0
    assert figures["cpu_us_per_call_me"] >= 0 and figures["involuntary_ctx_switches_per_call_me"] >= 0
    assert figures.get("syscalls_per_call_me", 0) >= 0  # absent where perf is missing or may not trace


def test_a_process_that_is_gone_counts_nothing() -> None:
    assert context_switches(2**22 + 1) == (0, 0)


def test_the_memory_sampler_sees_anonymous_memory_apart_from_mapped_code() -> None:
    with MemorySampler(os.getpid(), interval_s=0.01) as memory:
        block = bytearray(64 * 1024 * 1024)
        block[::4096] = b"x" * len(block[::4096])  # touched: resident
        memory.sample()
        del block
    peaks = memory.peaks()
    assert peaks["peak_anon_mb"] >= 64 and peaks["file_mb_at_peak"] > 0
    assert resident_mb(2**22 + 7) == {}  # no such process


def test_env_settings_split_on_the_first_equals_and_refuse_a_value_without_one() -> None:
    import pytest

    from bench.harness import env_settings

    assert env_settings(["FULMEN_A=1", "FULMEN_B=x=y"]) == {"FULMEN_A": "1", "FULMEN_B": "x=y"}
    with pytest.raises(SystemExit, match="FULMEN_X=VALUE"):
        env_settings(["FULMEN_A"])


def test_a_bench_s_processes_get_its_broker_and_home_and_the_lever_last(monkeypatch: Any, tmp_path: Path) -> None:
    from bench.harness import fulmen_env

    monkeypatch.setenv("FULMEN_KAFKA_CLIENT", "from-the-shell")  # never leaks into a bench's processes
    monkeypatch.setenv("KEEP_ME", "1")
    env = fulmen_env("h:9092", tmp_path, ["FULMEN_OTLP_PORT=9", "FULMEN_KAFKA_CLIENT=librdkafka"], FULMEN_OTLP_PORT="8")
    assert env["KEEP_ME"] == "1" and env["FULMEN_KAFKA_BOOTSTRAP"] == "h:9092" and env["FULMEN_HOME"] == str(tmp_path)
    assert env["FULMEN_OTLP_PORT"] == "9" and env["FULMEN_KAFKA_CLIENT"] == "librdkafka"  # --env overrides the bench
