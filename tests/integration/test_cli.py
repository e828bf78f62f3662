"""The `fulmen` command as a user runs it, in its own process (the embedded store allows one per process)."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fulmen.infra.kafka.local import LocalKafka

pytestmark = pytest.mark.integration

FULMEN = [sys.executable, "-m", "fulmen.cli.main"]


def run(
    args: list[str], env: dict[str, str], timeout: int = 180, columns: int = 200
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | env | {"COLUMNS": str(columns)}
    return subprocess.run([*FULMEN, *args], env=full_env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture
def env(kafka_broker: LocalKafka, tmp_path: Path) -> dict[str, str]:
    return {
        "FULMEN_KAFKA_BOOTSTRAP": kafka_broker.bootstrap,
        "FULMEN_KAFKA_TOPIC_PREFIX": f"cli{tmp_path.name[-8:]}.",
        "FULMEN_HOME": str(tmp_path),
        "FULMEN_CLICKHOUSE_READ_PORT": "0",  # never query some other store's owner on the default port
    }


def test_smoke_runs_end_to_end(env: dict[str, str]) -> None:
    result = run(["smoke", "--json"], env)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["task_read_back"] and report["dead_lettered"]
    assert report["rows"] == {"spans": 2, "rollouts": 1, "transitions": 2, "model_versions": 1, "train_steps": 1}
    assert "fulmen sql" in result.stdout  # it shows the queries a user can run next


def test_sql_formats_and_refuses_writes(env: dict[str, str]) -> None:
    assert run(["store", "migrate"], env).returncode == 0
    query = "SELECT number AS n, toString(number) AS s, [number, 1] AS a FROM system.numbers LIMIT 3"
    as_csv = run(["sql", query, "--format", "csv"], env)
    assert as_csv.returncode == 0, as_csv.stderr
    assert list(csv.reader(io.StringIO(as_csv.stdout))) == [
        ["n", "s", "a"],
        ["0", "0", "[0, 1]"],
        ["1", "1", "[1, 1]"],
        ["2", "2", "[2, 1]"],
    ]
    as_json = run(["sql", query, "--format", "json"], env)
    assert json.loads(as_json.stdout)[2] == {"n": 2, "s": "2", "a": [2, 1]}
    table = run(["sql", "SELECT count() AS tables FROM system.tables WHERE database = 'fulmen'"], env)
    assert "tables" in table.stdout and "1 row" in table.stdout
    refused = run(["sql", "DROP DATABASE fulmen"], env)
    assert refused.returncode == 1 and "only reads are allowed" in refused.stderr
    assert "Traceback" not in refused.stderr
    broken = run(["sql", "SELECT nope FROM nowhere"], env)
    assert broken.returncode == 1 and "query failed" in broken.stderr


def test_kafka_topics_against_an_existing_cluster(env: dict[str, str]) -> None:
    result = run(["kafka", "topics", "--create"], env)
    assert result.returncode == 0, result.stderr
    assert (
        f"{env['FULMEN_KAFKA_TOPIC_PREFIX']}fulmen.models" in result.stdout
        and "cleanup.policy=compact" in result.stdout
    )
    down = run(["kafka", "down"], env)
    assert "not a local broker, nothing to stop" in down.stdout


def test_unreachable_cluster_is_a_clear_error(tmp_path: Path) -> None:
    from fulmen.infra.processes import free_port

    result = run(
        ["kafka", "status"],
        {
            "FULMEN_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}",
            "FULMEN_KAFKA_CONNECT_TIMEOUT_S": "2",
            "FULMEN_HOME": str(tmp_path),
        },
    )
    assert result.returncode == 1
    assert "no Kafka broker answered" in result.stderr and "FULMEN_KAFKA_BOOTSTRAP" in result.stderr


def test_sql_reaches_the_store_through_the_consumers_process(env: dict[str, str]) -> None:
    import time

    import httpx

    from fulmen.infra.processes import free_port

    port = free_port()
    env = env | {"FULMEN_CLICKHOUSE_READ_PORT": str(port)}
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | env
    consume = subprocess.Popen([*FULMEN, "consume"], env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ping", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        result = run(
            ["sql", "SELECT name FROM system.tables WHERE database = 'fulmen' AND name = 'otel_traces'", "-f", "csv"],
            env,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == ["name", "otel_traces"]
        refused = run(["sql", "TRUNCATE TABLE fulmen.otel_traces"], env)
        assert refused.returncode == 1 and "only reads are allowed" in refused.stderr
        plain = httpx.get(f"http://127.0.0.1:{port}/", params={"query": "SELECT 1 + 1"}, timeout=10)
        assert plain.status_code == 200 and plain.text == "2\n"
        assert httpx.post(f"http://127.0.0.1:{port}/", content=b"DROP DATABASE fulmen", timeout=10).status_code == 403
    finally:
        consume.send_signal(__import__("signal").SIGTERM)
        consume.wait(timeout=60)


def test_submit_then_rollouts_shows_them_queued(env: dict[str, str], tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"question": "1+1?"}\n{"question": "2+2?"}\n')
    result = run(["submit", str(tasks), "--group-size", "3"], env)
    assert result.returncode == 0, result.stderr
    assert "submitted 6 rollouts in 2 groups" in result.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": {}, "max_attempts": 0}\n')
    refused = run(["submit", str(bad)], env)
    assert refused.returncode == 1 and "bad.jsonl:1: RolloutRequest.max_attempts" in refused.stderr
    # The consumers store the queued events; `fulmen rollouts` reads them back through their read endpoint.
    import signal
    import time

    from fulmen.infra.processes import free_port

    port = free_port()
    env = env | {"FULMEN_CLICKHOUSE_READ_PORT": str(port)}
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | env
    consume = subprocess.Popen(
        [*FULMEN, "consume", "--sink", "rollouts"], env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        # Only once the consumers process owns the store and serves reads (else `rollouts` would open the
        # store itself and race the consumers for it).
        assert _wait_read_endpoint(port), "the consumers process never served reads"
        deadline = time.monotonic() + 90
        shown = run(["rollouts"], env, columns=100)
        while "│ queued │ 6 " not in shown.stdout and time.monotonic() < deadline:
            time.sleep(0.5)
            shown = run(["rollouts"], env, columns=100)
        assert "│ queued │ 6 " in shown.stdout, shown.stdout + shown.stderr
        # In a 100-column terminal: each rollout on one line, its id a unique prefix, its time to the second.
        lines = shown.stdout.splitlines()
        assert max(map(len, lines)) <= 100 and "ids are unique prefixes" in lines[-1], shown.stdout
        assert (
            sum(
                bool(re.match(r"│ [0-9a-f]{8,12} +│ 1 +│ queued +│ .* │ \d{4}-\d\d-\d\d \d\d:\d\d:\d\d │$", line))
                for line in lines
            )
            == 6
        ), shown.stdout
    finally:
        consume.send_signal(signal.SIGTERM)
        consume.wait(timeout=60)


def _wait_read_endpoint(port: int, timeout_s: float = 90) -> bool:
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ping", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    return False


@pytest.mark.security
def test_consume_stops_on_sigint_while_a_long_read_runs(env: dict[str, str]) -> None:
    """A read that would run two minutes must not hold `fulmen consume` after Ctrl-C (it used to ignore it)."""
    import signal
    import socket
    import time

    from fulmen.infra.processes import free_port

    port = free_port()
    env = env | {"FULMEN_CLICKHOUSE_READ_PORT": str(port), "FULMEN_CLICKHOUSE_READ_MAX_EXECUTION_S": "120"}
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | env
    consume = subprocess.Popen([*FULMEN, "consume"], env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert _wait_read_endpoint(port), "the consumers' read endpoint did not come up"
        sock = socket.create_connection(("127.0.0.1", port))
        body = b"SELECT count() FROM numbers(1000000000000)"
        sock.sendall(f"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(2)  # the read is running in the engine
        started = time.monotonic()
        consume.send_signal(signal.SIGINT)
        consume.wait(timeout=60)  # a liveness bound, half the read's own limit
        print(f"consume stopped {time.monotonic() - started:.1f} s after SIGINT with a long read running")
        assert consume.returncode in (0, -signal.SIGINT, 130)
        sock.close()
    finally:
        if consume.poll() is None:
            consume.kill()
            consume.wait()
