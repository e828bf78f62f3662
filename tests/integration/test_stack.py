"""`fulmen up --detach` / `status` / `down` as a user runs them, on the tiny model and the session's broker.

One stack, one test (starting it is most of the cost): it comes up, `status` says every service is up, an agent
of tests/agents pointed at the two printed settings gets an answer and its spans (the gateway's LLM span and one
the agent's own OpenTelemetry SDK exports) land in the store, a gateway killed with SIGKILL is reported and
restarted, and `fulmen down` leaves no process and no pid file behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from fulmen.infra.kafka.local import LocalKafka, process_alive
from fulmen.infra.processes import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

FULMEN = [sys.executable, "-m", "fulmen.cli.main"]


def fulmen(args: list[str], env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | env | {"COLUMNS": "250"}
    return subprocess.run([*FULMEN, *args], env=full_env, capture_output=True, text=True, timeout=timeout, check=False)


def printed(output: str, name: str) -> str:
    """The value of ``export NAME=value`` in ``fulmen up``'s output."""
    for line in output.splitlines():
        if line.strip().startswith(f"export {name}="):
            return line.split("=", 1)[1].strip()
    raise AssertionError(f"no {name} in:\n{output}")


def eventually(check, what: str, timeout_s: float = 120.0):
    """``check()`` until it is truthy (its value) or the deadline (a liveness bound, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            assert value, f"never happened: {what}"
            return value
        time.sleep(0.5)


@pytest.fixture
def env(kafka_broker: LocalKafka, tmp_path: Path) -> dict[str, str]:
    return {
        "FULMEN_KAFKA_BOOTSTRAP": kafka_broker.bootstrap,
        "FULMEN_KAFKA_TOPIC_PREFIX": f"up{tmp_path.name[-8:]}.",
        "FULMEN_HOME": str(tmp_path),
        "FULMEN_CLICKHOUSE_READ_PORT": str(free_port()),
        "FULMEN_OTLP_PORT": str(free_port()),
        "FULMEN_LLM_PORT": str(free_port()),
        "FULMEN_DASHBOARD_PORT": str(free_port()),
        "FULMEN_LLM_DEVICE": "cpu",
    }


def test_up_status_agent_restart_down(env: dict[str, str], tiny_model: Path, tmp_path: Path) -> None:
    stack = tmp_path / "stack"
    started = fulmen(["up", "--detach", "--model", str(tiny_model), "--window", "600"], env)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        otlp, base_url = (
            printed(started.stdout, "OTEL_EXPORTER_OTLP_ENDPOINT"),
            printed(started.stdout, "OPENAI_BASE_URL"),
        )
        assert otlp == f"http://127.0.0.1:{env['FULMEN_OTLP_PORT']}"
        assert base_url == f"http://127.0.0.1:{env['FULMEN_LLM_PORT']}/v1"
        assert "dashboard:" in started.stdout
        state = json.loads((stack / "state.json").read_text())
        names = [entry["name"] for entry in state["services"]]
        assert names[:3] == ["consume", "otlp-gateway", "llm-gateway"]
        assert {p.name for p in stack.glob("*.pid")} == {"up.pid", *(f"{name}.pid" for name in names)}

        shown = fulmen(["status"], env)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        for name in ["supervisor", "kafka", *names]:
            assert any(line.split()[1:2] == [name] and " up " in line for line in shown.stdout.splitlines()), (
                name,
                shown.stdout,
            )

        _agent_answers_and_its_spans_land(env, otlp, base_url)
        _every_service_says_what_it_did(env, state, started.stdout)
        old = {name: int((stack / f"{name}.pid").read_text()) for name in names} | {"up": state["pid"]}
        _killed_gateway_is_restarted(env, stack, old["otlp-gateway"])
        new_otlp = int((stack / "otlp-gateway.pid").read_text())
    finally:
        stopped = fulmen(["down"], env)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "stack stopped" in stopped.stdout
    for name, pid in old.items() | {("otlp-gateway (restarted)", new_otlp)}:
        assert not process_alive(pid), f"{name} (pid {pid}) outlived `fulmen down`"
    assert list(stack.glob("*.pid")) == [] and not (stack / "state.json").exists()
    again = fulmen(["status"], env)
    assert again.returncode == 3 and "no stack runs" in again.stdout
    assert "no stack runs" in fulmen(["down"], env).stdout


def _agent_answers_and_its_spans_land(env: dict[str, str], otlp: str, base_url: str) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from tests.agents.chat import ask

    model = httpx.get(f"{base_url}/models", timeout=10).json()["data"][0]["id"]
    assert ask({"question": "What is 2+3?"}, SimpleNamespace(base_url=base_url, api_key="none", model=model)) == 1.0
    provider = TracerProvider(resource=Resource.create({"service.name": "stack-test-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{otlp}/v1/traces")))
    with provider.get_tracer("tests.stack").start_as_current_span("stack-test-step"):
        pass
    provider.shutdown()

    def names() -> set[str]:
        done = fulmen(["sql", "SELECT DISTINCT SpanName, ServiceName FROM fulmen.otel_traces", "-f", "jsonl"], env)
        assert done.returncode == 0, done.stdout + done.stderr
        rows = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
        found = {row["SpanName"] for row in rows}
        return found if "stack-test-step" in found and any(n.startswith("chat") for n in found) else set()

    eventually(names, "the agent's span and the gateway's chat span in fulmen.otel_traces")


def _every_service_says_what_it_did(env: dict[str, str], state: dict, up_output: str) -> None:
    """Each service's /metrics answers (the URLs `fulmen up` printed), and `fulmen status` says what each did."""
    urls = {entry["name"]: entry["metrics_url"] for entry in state["services"] if entry.get("metrics_url")}
    assert set(urls) == {"consume", "otlp-gateway", "llm-gateway"}
    assert all(url in up_output for url in urls.values()), up_output
    for name, url in urls.items():
        answer = httpx.get(url, timeout=10)
        assert answer.status_code == 200 and "process_start_time_seconds" in answer.text, name
    assert (
        'fulmen_gateway_requests_total{gateway="llm",route="/v1/chat/completions",status="200"}'
        in httpx.get(urls["llm-gateway"], timeout=10).text
    )
    shown = fulmen(["status"], env).stdout
    said = {line.split()[0]: line for line in shown.split("what each did", 1)[-1].splitlines()[1:] if line.strip()}
    assert " calls (" in said["llm-gateway"] and "model v0" in said["llm-gateway"], shown
    assert " spans (" in said["otlp-gateway"] and " rows stored (" in said["consume"], shown


def _killed_gateway_is_restarted(env: dict[str, str], stack: Path, pid: int) -> None:
    os.kill(pid, signal.SIGKILL)

    def restarted() -> bool:
        log = (stack / "up.log").read_text(errors="replace")
        return "otlp-gateway exited with -9" in log and "otlp-gateway restarted (pid" in log

    eventually(restarted, "the killed OTLP gateway reported and restarted")
    log = (stack / "up.log").read_text(errors="replace")
    assert "restarting otlp-gateway (restart 1 of at most 3 within 600s)" in log
    assert int((stack / "otlp-gateway.pid").read_text()) != pid
    shown = fulmen(["status"], env)
    assert shown.returncode == 0, shown.stdout
    assert any("otlp-gateway" in line and " up " in line and "1 restarts" in line for line in shown.stdout.splitlines())


def test_a_kafka_that_submit_started_is_said_and_down_stops_it(tmp_path: Path) -> None:
    env = {
        "FULMEN_HOME": str(tmp_path),
        "FULMEN_BROKER_PORT": str(free_port()),
        "FULMEN_BROKER_CONTROLLER_PORT": str(free_port()),
    }
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"question": "What is 2+3?", "answer": 5}\n')
    try:
        first = fulmen(["submit", str(tasks)], env)
        assert first.returncode == 0, first.stdout + first.stderr
        said = " ".join(first.stderr.split())
        assert "fulmen submit: started a local Kafka" in said and "`fulmen down`" in said
        second = fulmen(["submit", str(tasks)], env)
        assert second.returncode == 0 and "started a local Kafka" not in second.stderr  # it ran already
    finally:
        stopped = fulmen(["down"], env)
    assert "no stack runs" in stopped.stdout and "stopped the local Kafka" in stopped.stdout, stopped.stdout
    assert "local Kafka was not running" in fulmen(["kafka", "down"], env).stdout
