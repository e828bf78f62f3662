"""Issue 11, runner side: prefixed consumer groups, masked settings, SASL errors, runner help, sync agents that
can (process) or cannot (thread) be stopped, an agent's own tracer provider (set up at import or late) neither
doubling the export nor missing the rollout's stamp, retry backoff."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fulmen.cli.main import app
from fulmen.infra.kafka.clients import connection_kwargs, consumer, consumer_group
from fulmen.infra.kafka.dlq import DeadLetters
from fulmen.infra.settings import FulmenSettings
from fulmen.producers.runner.agent import AgentError, LLMEndpoint
from fulmen.producers.runner.backoff import (
    NOT_BEFORE_KEY,
    DelayedRequests,
    hold_until,
    not_before,
    retry_delay_s,
    with_not_before,
)
from fulmen.producers.runner.settings import RunnerSection
from fulmen.producers.runner.sync import ProcessAgent, ThreadAgent
from fulmen.schemas import RolloutRequest
from fulmen.schemas.errors import ConfigurationError

pytestmark = pytest.mark.security

LLM = LLMEndpoint(base_url="http://127.0.0.1:1/rollout/r/attempt/1/v1", model="m")
ROOT = Path(__file__).resolve().parents[2]


def with_prefix(prefix: str) -> FulmenSettings:
    return FulmenSettings(kafka={"bootstrap": "127.0.0.1:1", "topic_prefix": prefix})


# --- consumer groups -----------------------------------------------------------------------------------------
FULMEN_GROUPS = ["fulmen.runners", "fulmen.trainer", "fulmen.consumers.spans", "fulmen.consumers.transition_builder"]


async def test_two_prefixes_get_disjoint_consumer_groups() -> None:
    joined = {}
    for prefix in ("outside.", "inside."):
        settings = with_prefix(prefix)
        joined[prefix] = {consumer(settings, group)._group_id for group in FULMEN_GROUPS}
        assert joined[prefix] == {f"{prefix}{group}" for group in FULMEN_GROUPS}
        # the names given to the broker elsewhere match the groups joined
        assert {consumer_group(settings, group) for group in FULMEN_GROUPS} == joined[prefix]
        dead_letters = DeadLetters(None, prefix=prefix, consumer_group="fulmen.consumers.rollouts")  # type: ignore[arg-type]
        assert dead_letters.consumer_group == f"{prefix}fulmen.consumers.rollouts"
    assert not joined["outside."] & joined["inside."]


async def test_an_explicit_group_is_kept_as_given() -> None:
    assert consumer(with_prefix("outside."), "my-runners")._group_id == "my-runners"
    assert consumer(with_prefix("outside."), None)._group_id is None


# --- secrets ------------------------------------------------------------------------------------------------
SECRETS = {
    "FULMEN_CLICKHOUSE_URL": "https://alice:userinfo-s3cret@ch.example:8443/db?password=query-s3cret&x=1",
    "FULMEN_KAFKA_SASL_PASSWORD": "sasl-s3cret",
    "FULMEN_KAFKA_SASL_USERNAME": "bob",
    "FULMEN_OTLP_BEARER_TOKEN": "otlp-s3cret",
    "FULMEN_LLM_UPSTREAM_API_KEY": "llm-key-s3cret",
    "FULMEN_LLM_UPSTREAM_URL": "https://carol:upstream-s3cret@llm.example/v1?api_key=upstream-key-s3cret",
    "FULMEN_LLM_BEARER_TOKEN": "llm-s3cret",
}


def test_config_show_never_prints_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, ["config", "show"])
    assert result.exit_code == 0, result.output
    assert "s3cret" not in result.output
    shown = json.loads(result.output)
    assert shown["clickhouse"]["url"].startswith("https://alice:***@ch.example:8443/db?password=***")
    assert shown["kafka"]["sasl_password"] == "***" and shown["otlp"]["bearer_token"] == "***"
    assert shown["llm"]["upstream_url"].startswith("https://carol:***@llm.example/v1")


def test_the_store_location_masks_the_url_query() -> None:
    from fulmen.infra.store.store import _safe_url

    settings = FulmenSettings(clickhouse={"url": SECRETS["FULMEN_CLICKHOUSE_URL"]})
    assert "s3cret" not in _safe_url(settings) and "ch.example:8443" in _safe_url(settings)


def test_oauthbearer_is_a_configuration_error_saying_what_to_set() -> None:
    settings = FulmenSettings(
        kafka={"bootstrap": "k:9092", "security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "OAUTHBEARER"}
    )
    with pytest.raises(ConfigurationError, match="supported: PLAIN, SCRAM-SHA-256, SCRAM-SHA-512"):
        connection_kwargs(settings)


def test_oauthbearer_from_the_cli_is_one_message_not_a_traceback(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")}
    env.update(
        FULMEN_KAFKA_BOOTSTRAP="127.0.0.1:1",
        FULMEN_KAFKA_SECURITY_PROTOCOL="SASL_PLAINTEXT",
        FULMEN_KAFKA_SASL_MECHANISM="OAUTHBEARER",
        FULMEN_HOME=str(tmp_path),
    )
    done = subprocess.run(
        [sys.executable, "-m", "fulmen.cli.main", "kafka", "topics"],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "FULMEN_KAFKA_SASL_MECHANISM" in done.stderr


# --- runner help ----------------------------------------------------------------------------------------------
def test_runner_help_lists_every_runner_setting() -> None:
    result = CliRunner().invoke(app, ["runner", "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    for name in RunnerSection.model_fields:
        assert f"FULMEN_RUNNER_{name.upper()}" in result.output
    assert "FULMEN_RUNNER_LLM_BASE_URL; default http://127.0.0.1:8000" in result.output
    assert "--llm-base-url" in result.output and "--concurrency" in result.output


# --- sync agents ----------------------------------------------------------------------------------------------
release = threading.Event()


def blocking_agent(task: dict, llm: object) -> float:
    release.wait(60)
    return 1.0


def pid_then_sleep(task: dict, llm: object) -> float:
    Path(task["pid_file"]).write_text(str(os.getpid()))
    time.sleep(120)
    return 1.0


def half(task: dict, llm: object) -> float:
    print("agents may print; the reply is not disturbed")
    return 0.5 if llm.base_url.endswith("/v1") else -1.0


def raises(task: dict, llm: object) -> float:
    raise RuntimeError("no luck")


async def test_thread_mode_caps_threads_and_says_a_timed_out_agent_runs_on(caplog: pytest.LogCaptureFixture) -> None:
    caller = ThreadAgent(blocking_agent, max_threads=1)
    release.clear()
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(TimeoutError):
            await asyncio.wait_for(caller.call({}, LLM), 0.2)
        assert "cannot be stopped" in caplog.text and "FULMEN_RUNNER_SYNC_ISOLATION=process" in caplog.text
        assert caller.busy == 1 and caller.executor._max_workers == 1  # still running, in the one thread allowed
    finally:
        release.set()
        caller.close()


async def test_process_mode_returns_rewards_and_errors() -> None:
    module = "tests.unit.test_runner_security"
    assert await ProcessAgent(f"{module}:half", None).call({}, LLM) == 0.5
    with pytest.raises(AgentError, match="RuntimeError: no luck"):
        await ProcessAgent(f"{module}:raises", None).call({}, LLM)


async def test_process_mode_kills_a_timed_out_agent(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    caller = ProcessAgent("tests.unit.test_runner_security:pid_then_sleep", None)
    call = asyncio.create_task(caller.call({"pid_file": str(pid_file)}, LLM))
    for _ in range(600):  # the agent's process has started when it wrote its pid
        if pid_file.exists() and pid_file.read_text():
            break
        await asyncio.sleep(0.1)
    pid = int(pid_file.read_text())
    call.cancel()  # what asyncio.wait_for does on timeout
    with pytest.raises(asyncio.CancelledError):
        await call
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not caller.processes


# --- an agent's own tracer provider ----------------------------------------------------------------------------
AGENT_SETUP = """
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from fulmen.producers.runner.tracing import build_tracer_provider, exports_to

# what pydantic-ai's docs have an agent do at import: its own provider, exporting by OTLP, installed globally
agent_provider = TracerProvider()
agent_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint="{agent_endpoint}")))
trace.set_tracer_provider(agent_provider)

runner_provider = build_tracer_provider("http://127.0.0.1:4318/v1/traces")
exporters = sum(1 for p in agent_provider._active_span_processor._span_processors if hasattr(p, "_batch_processor"))
print(runner_provider is agent_provider, exporters)
"""


@pytest.mark.parametrize(
    ("agent_endpoint", "expected"),
    [("http://localhost:4318/v1/traces/", "True 1"), ("http://collector.example:4318/v1/traces", "False 2")],
)
def test_the_runner_adds_no_second_exporter_to_the_same_endpoint(agent_endpoint: str, expected: str) -> None:
    script = AGENT_SETUP.format(agent_endpoint=agent_endpoint)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == expected, done.stderr


LATE_AGENT_SETUP = """
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from fulmen.producers.runner.tracing import CURRENT_ROLLOUT, build_tracer_provider, flush_all, joined_providers
from fulmen.schemas import RolloutRequest, semconv

runner_provider = build_tracer_provider("http://127.0.0.1:4318/v1/traces")
CURRENT_ROLLOUT.set(RolloutRequest(rollout_id="r7", task_id="t", group_id="g", input={{}}))

# the agent's first call: its own provider, too late to be installed, so it traces on the object itself
agent_provider = TracerProvider()
agent_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint="{agent_endpoint}")))
memory = InMemorySpanExporter()
agent_provider.add_span_processor(SimpleSpanProcessor(memory))
trace.set_tracer_provider(agent_provider)  # refused: the runner's is installed
agent_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint="{agent_endpoint}")))
with agent_provider.get_tracer("agent").start_as_current_span("agent run"):
    pass
(span,) = memory.get_finished_spans()
stampers = sum(type(p).__name__ == "RolloutStamper" for p in agent_provider._active_span_processor._span_processors)
print(span.attributes.get(semconv.ROLLOUT_ID), stampers, agent_provider in joined_providers(),
      trace.get_tracer_provider() is runner_provider)
"""


@pytest.mark.parametrize(
    ("agent_endpoint", "expected"),
    [
        ("http://localhost:4318/v1/traces", "r7 1 True True"),
        ("http://collector.example:4318/v1/traces", "None 0 False True"),
    ],
)
def test_a_provider_the_agent_builds_late_is_stamped_when_it_exports_to_the_runners_endpoint(
    agent_endpoint: str, expected: str
) -> None:
    script = LATE_AGENT_SETUP.format(agent_endpoint=agent_endpoint)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == expected, done.stderr


async def test_the_runners_flush_covers_the_joined_providers() -> None:
    from fulmen.producers.runner import tracing

    flushed: list[str] = []

    class Provider:
        def __init__(self, name: str) -> None:
            self.name = name

        def force_flush(self, timeout_millis: int = 30_000) -> bool:
            flushed.append(self.name)
            return True

    runner, agent = Provider("runner"), Provider("agent")
    joined = tracing._AGENT_PROVIDERS.joined
    joined.add(agent)  # type: ignore[arg-type]
    try:
        await tracing.CoalescedFlush(runner).flush()
    finally:
        joined.discard(agent)  # type: ignore[arg-type]
    assert flushed == ["runner", "agent"]


# --- retry backoff --------------------------------------------------------------------------------------------
def test_the_retry_wait_doubles_per_attempt_up_to_the_cap_and_jitter_only_adds() -> None:
    assert [retry_delay_s(n, 2.0, 60.0, 0.0) for n in (1, 2, 3, 4, 5, 6, 99)] == [2, 4, 8, 16, 32, 60, 60]
    assert retry_delay_s(3, 2.0, 60.0, 0.5, uniform=lambda: 0.0) == 8.0
    assert retry_delay_s(3, 2.0, 60.0, 0.5, uniform=lambda: 0.999) == pytest.approx(8.0 * 1.4995)
    assert retry_delay_s(3, 0.0, 60.0, 0.5) == 0.0  # 0 = retry at once


def test_a_not_before_time_travels_in_the_metadata_and_is_held_at_most_the_longest_wait() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    request = RolloutRequest(task_id="t", group_id="g", input={}, metadata={"user": "kept"})
    assert not_before(request) is None and hold_until(request, now, 60) is None
    later = with_not_before(request, now + timedelta(seconds=5))
    assert later.metadata["user"] == "kept" and not_before(later) == now + timedelta(seconds=5)
    assert hold_until(later, now, 60) == now + timedelta(seconds=5)
    assert hold_until(later, now + timedelta(seconds=6), 60) is None  # due already
    far = with_not_before(request, now + timedelta(days=365))  # a forged or skewed time: offsets not held for it
    assert hold_until(far, now, 60) == now + timedelta(seconds=60)
    garbled = request.model_copy(update={"metadata": {NOT_BEFORE_KEY: "soon"}})
    assert not_before(garbled) is None


def test_held_requests_come_out_when_due_earliest_first_bounded_and_droppable() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    held: DelayedRequests[str] = DelayedRequests()
    for name, seconds in (("c", 3), ("a", 1), ("b", 2), ("a2", 1), ("gone", 0)):
        held.push(name, now + timedelta(seconds=seconds))
    held.drop(lambda name: name == "gone")
    assert held.next_at == now + timedelta(seconds=1) and len(held) == 4
    assert held.pop_due(now, 10) == []
    assert held.pop_due(now + timedelta(seconds=2), 2) == ["a", "a2"]  # at most as many as free slots
    assert held.pop_due(now + timedelta(seconds=2), 2) == ["b"]
    assert held.pop_due(now + timedelta(seconds=9), 2) == ["c"] and held.next_at is None


def test_retry_settings_have_backoff_defaults() -> None:
    section = RunnerSection()
    assert section.retry_backoff_s > 0 and section.retry_backoff_max_s >= section.retry_backoff_s
    assert section.longest_retry_wait_s == section.retry_backoff_max_s * (1 + section.retry_jitter)


# --- a rebalance during a commit ------------------------------------------------------------------------------
async def test_a_partition_revoked_while_its_commit_is_in_flight_does_not_crash_the_runner() -> None:
    """Seen under load: the heartbeat expired, the group rebalanced during `commit`, the partition's progress
    was dropped, and the runner died with a KeyError (the demo then waited for rollouts nobody ran)."""
    from aiokafka import TopicPartition

    from fulmen.infra.kafka.offsets import OffsetTracker
    from fulmen.producers.runner.app import Runner

    revoked, kept = TopicPartition("tasks", 0), TopicPartition("tasks", 1)
    runner = object.__new__(Runner)  # only the commit path is exercised: no clients, no settings
    runner.runner_id, runner._committed_at = "r", 0.0
    runner.offsets = OffsetTracker()
    for tp in (revoked, kept):
        for offset in range(7):
            runner.offsets.read(tp, offset)
        for offset in range(5):
            runner._finish(tp, offset)
    sent: list[dict[TopicPartition, int]] = []

    class _Tasks:
        def assignment(self) -> set[TopicPartition]:
            return {revoked, kept}

        async def commit(self, offsets: dict) -> None:
            sent.append({tp: meta.offset for tp, meta in offsets.items()})
            runner.offsets.forget([revoked])  # the rebalance listener runs while the commit is in flight
            runner._finish(kept, 5)  # and more of this partition finishes meanwhile
            runner._finish(kept, 6)

    runner.tasks = _Tasks()
    await runner._commit()
    assert sent == [{revoked: 5, kept: 5}]
    runner._finish(revoked, 6)  # a rollout of the revoked partition ends: ignored, its new owner commits it
    assert runner.offsets.committable() == {kept: 7}  # still to commit: it was not what went out
