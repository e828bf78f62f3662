"""The runner against a real broker: lifecycle, rewards, retries, timeouts, kill -9, several processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fulmen.infra.kafka.clients import consumer, start_or_raise
from fulmen.infra.settings import FulmenSettings
from fulmen.producers.runner import Runner, RunnerSettings, load_agent
from fulmen.producers.runner.tracing import ExportFailures, RolloutStamper
from fulmen.schemas import RolloutEvent, RolloutRequest, RolloutStatus, TopicKey, decode, semconv, topic, topic_name
from fulmen.testing.publishing import event_publisher

pytestmark = pytest.mark.integration

FULMEN = [sys.executable, "-m", "fulmen.cli.main"]


def runner_settings(settings: FulmenSettings, agent: str, concurrency: int = 4) -> RunnerSettings:
    return RunnerSettings(
        home=settings.home,
        kafka=settings.kafka.model_dump(),
        clickhouse=settings.clickhouse.model_dump(),
        runner={"agent": agent, "concurrency": concurrency, "otlp_endpoint": "", "shutdown_grace_s": 5},
    )


@asynccontextmanager
async def runner_running(
    settings: FulmenSettings,
    agent: str,
    provider: TracerProvider | None = None,
    concurrency: int = 4,
    failures: ExportFailures | None = None,
) -> AsyncIterator[Runner]:
    options = runner_settings(settings, agent, concurrency)
    runner = Runner(options, load_agent(agent), tracer_provider=provider or TracerProvider(), export_failures=failures)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        yield runner
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


def global_provider_with(exporter: InMemorySpanExporter) -> TracerProvider:
    """The process's global provider (as the runner installs it: agents' own tracers use it), exporting to
    ``exporter`` too."""
    current = trace.get_tracer_provider()
    if not isinstance(current, TracerProvider):
        current = TracerProvider()
        current.add_span_processor(RolloutStamper())
        trace.set_tracer_provider(current)
    current.add_span_processor(SimpleSpanProcessor(exporter))
    return current


async def submit(settings: FulmenSettings, requests: list[RolloutRequest]) -> None:
    async with event_publisher(settings) as publisher:
        await publisher.publish_many(TopicKey.TASKS, requests)


async def events_by_rollout(settings: FulmenSettings) -> dict[str, list[RolloutEvent]]:
    reader = consumer(settings, None)
    await start_or_raise(reader, settings)
    name = topic_name(TopicKey.ROLLOUTS, settings.kafka.topic_prefix)
    partitions = [TopicPartition(name, p) for p in range(topic(TopicKey.ROLLOUTS).partitions)]
    events: dict[str, list[RolloutEvent]] = defaultdict(list)
    try:
        reader.assign(partitions)
        await reader.seek_to_beginning(*partitions)
        ends = await reader.end_offsets(partitions)
        while [tp for tp, end in ends.items() if await reader.position(tp) < end]:
            for records in (await reader.getmany(timeout_ms=500)).values():
                for record in records:
                    event = decode(RolloutEvent, record.value)
                    events[event.rollout_id].append(event)
    finally:
        await reader.stop()
    return events


async def wait_terminal(settings: FulmenSettings, rollouts: set[str], final: int = 1, timeout_s: float = 90) -> dict:
    """Wait until each rollout has ``final`` terminal events at least; return all events by rollout."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = await events_by_rollout(settings)
        done = {r for r in rollouts if sum(e.status.terminal for e in events.get(r, [])) >= final}
        if done == rollouts or time.monotonic() > deadline:
            return events
        await asyncio.sleep(0.5)


def request(rollout: str, agent_input: dict, **fields: object) -> RolloutRequest:
    return RolloutRequest(rollout_id=rollout, task_id=f"task-{rollout}", group_id="g1", input=agent_input, **fields)


async def test_rollouts_run_with_their_lifecycle_rewards_and_stamped_spans(settings: FulmenSettings) -> None:
    exporter = InMemorySpanExporter()
    provider = global_provider_with(exporter)
    rollouts = {f"r{i}": i / 10 for i in range(6)}
    seeds = {"r5": 5}  # a seeded rollout's calls reach the gateway under /seed/<its seed>
    await submit(
        settings, [request(r, {"reward": reward, "sleep": 0.2}, seed=seeds.get(r)) for r, reward in rollouts.items()]
    )
    async with runner_running(settings, "tests.agents.simple:echo_reward", provider, concurrency=3) as runner:
        events = await wait_terminal(settings, set(rollouts))
    for rollout, reward in rollouts.items():
        statuses = [e.status for e in events[rollout]]
        assert statuses == [RolloutStatus.CLAIMED, RolloutStatus.RUNNING, RolloutStatus.SUCCEEDED], rollout
        assert events[rollout][-1].reward == reward and events[rollout][-1].runner_id == runner.runner_id
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == semconv.SPAN_ROLLOUT]
    thinks = [s for s in spans if s.name == "think"]
    assert len(roots) == 6 and len(thinks) == 6
    for think in thinks:
        rollout = think.attributes[semconv.ROLLOUT_ID]
        seed = f"/seed/{seeds[rollout]}" if rollout in seeds else ""
        assert think.attributes["base_url"].endswith(f"/rollout/{rollout}/attempt/1{seed}/v1")
        parent = next(r for r in roots if r.context.span_id == think.parent.span_id)
        assert (
            parent.attributes[semconv.ROLLOUT_ID] == rollout
            and parent.attributes[semconv.REWARD_VALUE] == rollouts[rollout]
        )
    assert runner.completed["succeeded"] == 6


async def test_failures_and_timeouts_are_retried_with_new_attempts(settings: FulmenSettings, tmp_path: Path) -> None:
    await submit(
        settings,
        [
            request("flaky", {"dir": str(tmp_path), "name": "flaky"}, max_attempts=3),
            request("bad", {}, max_attempts=2),
        ],
    )
    async with runner_running(settings, "tests.agents.simple:flaky"):
        events = await wait_terminal(settings, {"flaky"}, final=2)  # the retry waits out its backoff first
    assert [(e.attempt, e.status) for e in events["flaky"] if e.status.terminal] == [
        (1, RolloutStatus.FAILED),
        (2, RolloutStatus.SUCCEEDED),
    ]
    assert "first try fails" in next(e.error for e in events["flaky"] if e.status is RolloutStatus.FAILED)
    async with runner_running(settings, "tests.agents.simple:always_fails"):
        events = await wait_terminal(settings, {"bad"}, final=2)
        await asyncio.sleep(1.5)  # no third attempt comes
        events = await events_by_rollout(settings)
    assert [(e.attempt, e.status) for e in events["bad"] if e.status.terminal] == [
        (1, RolloutStatus.FAILED),
        (2, RolloutStatus.FAILED),
    ]


async def test_a_timeout_is_reported_then_retried(settings: FulmenSettings) -> None:
    await submit(settings, [request("slow", {"sleep": 30}, timeout_s=0.5, max_attempts=2)])
    async with runner_running(settings, "tests.agents.simple:async_echo"):
        events = await wait_terminal(settings, {"slow"}, final=2)
    terminal = [(e.attempt, e.status) for e in events["slow"] if e.status.terminal]
    assert terminal == [(1, RolloutStatus.TIMED_OUT), (2, RolloutStatus.TIMED_OUT)]
    assert "no result within 0.5s" in events["slow"][-1].error


def _spawn_runner(settings: FulmenSettings, agent: str, log: Path, concurrency: int = 4) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {
        "FULMEN_KAFKA_BOOTSTRAP": settings.bootstrap,
        "FULMEN_KAFKA_TOPIC_PREFIX": settings.kafka.topic_prefix,
        "FULMEN_HOME": str(settings.home),
        "FULMEN_RUNNER_OTLP_ENDPOINT": "",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    with open(log, "ab") as out:
        return subprocess.Popen(
            [*FULMEN, "runner", "--agent", agent, "--concurrency", str(concurrency)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def test_kill_9_mid_rollout_runs_the_next_attempt_on_another_runner(
    settings: FulmenSettings, tmp_path: Path
) -> None:
    log = tmp_path / "runners.log"
    runners = [_spawn_runner(settings, "tests.agents.simple:slow_once", log) for _ in range(2)]
    try:
        await submit(settings, [request("victim", {"dir": str(tmp_path), "name": "victim", "first_sleep": 60})])
        marker = tmp_path / "victim.started"
        deadline = time.monotonic() + 90
        while not marker.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert marker.exists(), log.read_text()[-3000:]
        victim_pid = int(marker.read_text())
        victim = next(r for r in runners if r.pid == victim_pid)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        events = await wait_terminal(settings, {"victim"}, final=2, timeout_s=120)
        terminal = [(e.attempt, e.status) for e in events["victim"] if e.status.terminal]
        assert terminal == [(1, RolloutStatus.FAILED), (2, RolloutStatus.SUCCEEDED)], log.read_text()[-3000:]
        assert "was lost during attempt 1" in next(
            e.error for e in events["victim"] if e.status is RolloutStatus.FAILED
        )
    finally:
        for process in runners:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in runners:
            process.wait(timeout=60)


async def test_100_rollouts_over_4_runner_processes_each_succeed_once(settings: FulmenSettings, tmp_path: Path) -> None:
    log = tmp_path / "runners.log"
    runners = [_spawn_runner(settings, "tests.agents.simple:async_echo", log, concurrency=8) for _ in range(4)]
    try:
        rollouts = {f"many-{i}" for i in range(100)}
        # Each rollout takes long enough (100 x 0.5 s over 8 slots) that all four runners join before one ends it all.
        await submit(settings, [request(r, {"reward": 1.0, "sleep": 0.5}) for r in sorted(rollouts)])
        events = await wait_terminal(settings, rollouts, timeout_s=180)
        await asyncio.sleep(2)  # anything doubled would show up by now
        events = await events_by_rollout(settings)
    finally:
        for process in runners:
            process.send_signal(signal.SIGTERM)
        for process in runners:
            process.wait(timeout=60)
    succeeded = {r: [e for e in events[r] if e.status is RolloutStatus.SUCCEEDED] for r in rollouts}
    assert all(len(s) == 1 for s in succeeded.values()), log.read_text()[-3000:]
    assert len({s[0].runner_id for s in succeeded.values()}) >= 2  # the work was spread


def test_a_bad_agent_path_is_a_clear_start_up_error(settings: FulmenSettings, tmp_path: Path) -> None:
    process = _spawn_runner(settings, "tests.agents.nope:agent", tmp_path / "bad.log")
    assert process.wait(timeout=60) == 1
    text = (tmp_path / "bad.log").read_text()
    assert "cannot import the agent module 'tests.agents.nope'" in text and "Traceback" not in text


async def test_sigterm_lets_running_rollouts_finish(settings: FulmenSettings, tmp_path: Path) -> None:
    log = tmp_path / "runner.log"
    process = _spawn_runner(settings, "tests.agents.simple:slow_once", log)
    try:
        await submit(settings, [request("graceful", {"dir": str(tmp_path), "name": "graceful", "first_sleep": 3})])
        marker = tmp_path / "graceful.started"
        deadline = time.monotonic() + 90
        while not marker.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 60) == 0, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    events = await events_by_rollout(settings)
    assert [(e.attempt, e.status) for e in events["graceful"] if e.status.terminal] == [(1, RolloutStatus.SUCCEEDED)]


async def test_an_agent_project_with_its_own_schemas_infra_and_consumers_runs(
    settings: FulmenSettings, tmp_path: Path
) -> None:
    """A common layout (pydantic ``schemas.py``, ``infra/``, ``consumers/``) next to the agent: the runner started
    in that directory imports the project's modules, not Fulmen's (which are all under ``fulmen.``)."""
    project = tmp_path / "project"
    (project / "infra").mkdir(parents=True)
    (project / "consumers").mkdir()
    (project / "schemas.py").write_text("from pydantic import BaseModel\n\nclass Score(BaseModel):\n    value: float\n")
    (project / "infra" / "__init__.py").write_text("BASE = 0.5\n")
    (project / "consumers" / "__init__.py").write_text("BONUS = 0.25\n")
    (project / "agent.py").write_text(
        "import consumers\nfrom infra import BASE\nfrom schemas import Score\n\n"
        "async def solve(task, llm):\n    return Score(value=BASE + consumers.BONUS).value\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_") and k != "PYTHONPATH"} | {
        "FULMEN_KAFKA_BOOTSTRAP": settings.bootstrap,
        "FULMEN_KAFKA_TOPIC_PREFIX": settings.kafka.topic_prefix,
        "FULMEN_HOME": str(settings.home),
        "FULMEN_RUNNER_OTLP_ENDPOINT": "",
    }
    log = tmp_path / "runner.log"
    with open(log, "ab") as out:
        runner = subprocess.Popen(
            [*FULMEN, "runner", "--agent", "agent:solve"], cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        await submit(settings, [request("own-modules", {})])
        events = await wait_terminal(settings, {"own-modules"}, timeout_s=120)
    finally:
        runner.send_signal(signal.SIGTERM)
        await asyncio.to_thread(runner.wait, 60)
    (done,) = [e for e in events["own-modules"] if e.status.terminal]
    assert (done.status, done.reward) == (RolloutStatus.SUCCEEDED, 0.75), log.read_text()[-3000:]


class _FailsFirstAttempts(InMemorySpanExporter):
    """Fails every export that holds a span of a rollout's first attempt."""

    def export(self, spans):  # type: ignore[no-untyped-def]
        from opentelemetry.sdk.trace.export import SpanExportResult

        if any((span.attributes or {}).get(semconv.ROLLOUT_ATTEMPT) == 1 for span in spans):
            return SpanExportResult.FAILURE
        return super().export(spans)


async def test_a_rollout_whose_spans_were_not_exported_fails_and_is_retried(settings: FulmenSettings) -> None:
    """Its agent succeeded, but training on it would miss spans: the attempt ends failed, saying why, and the next
    attempt (spans exported) is the one that succeeds."""
    from fulmen.producers.runner.tracing import NotingExporter

    failures = ExportFailures()
    provider = TracerProvider()
    provider.add_span_processor(RolloutStamper())
    provider.add_span_processor(SimpleSpanProcessor(NotingExporter(_FailsFirstAttempts(), failures)))
    await submit(settings, [request("lost-spans", {"reward": 1.0}, max_attempts=2)])
    async with runner_running(settings, "tests.agents.simple:echo_reward", provider, failures=failures):
        events = await wait_terminal(settings, {"lost-spans"}, final=2)
    ends = [e for e in events["lost-spans"] if e.status.terminal]
    assert [(e.attempt, e.status, e.reward) for e in ends] == [
        (1, RolloutStatus.FAILED, None),
        (2, RolloutStatus.SUCCEEDED, 1.0),
    ]
    assert "spans were not exported" in (ends[0].error or "")
