"""Late feedback against a real broker and the embedded store: sent through the LLM gateway's ``POST /v1/feedback``
or ``fulmen feedback``, resolved by the feedback consumer to the call or episode it scores, the latest one winning;
an unknown target dead-lettered with the reason once the grace is over, never dropped."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import TopicPartition
from openai import AsyncOpenAI

from fulmen.consumers import ConsumerOptions, ConsumersApp, default_sinks
from fulmen.consumers.feedback import FeedbackSection, FeedbackSink, FeedbackWorker
from fulmen.infra.kafka.clients import close_quietly, consumer, producer, start_or_raise
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store
from fulmen.producers.feedback import SENDER
from fulmen.producers.llm_gateway import LlmGateway
from fulmen.schemas import DeadLetterHeaders, Feedback, RolloutStatus, TopicKey, semconv, topic, topic_name
from fulmen.schemas.codec import decode
from fulmen.testing.llm_pipeline import base_url, llm_gateway_running, llm_settings
from fulmen.testing.publishing import event_publisher
from tests.integration.test_llm_gateway import _DeadProducer
from tests.integration.transition_pipeline import ended, llm_call, produce_spans
from tests.polling import count_reaches

pytestmark = [pytest.mark.integration, pytest.mark.continuous]

LATEST = (
    "SELECT RolloutId, SpanId, argMax(Value, Timestamp) FROM {db}.feedback FINAL WHERE Name = 'reward' "
    "GROUP BY RolloutId, SpanId ORDER BY RolloutId, SpanId"
)
"""The query replay reads rewards with: per call (SpanId) or episode (SpanId ''), the latest feedback wins."""


@asynccontextmanager
async def consumers_running(
    settings: FulmenSettings, store: Store, grace_s: float = 30
) -> AsyncIterator[FeedbackWorker]:
    """The table sinks (spans, rollouts, dead letters...) and the feedback consumer; yields its worker."""
    section = FeedbackSection(resolve_grace_s=grace_s, retry_first_s=0.1, retry_max_s=0.5)
    stop, ready = asyncio.Event(), asyncio.Event()
    app = ConsumersApp(settings, store, [*default_sinks(), FeedbackSink(section)], ConsumerOptions(max_wait_s=0.1))
    task = asyncio.create_task(app.run(stop, ready))
    await asyncio.wait_for(ready.wait(), 60)
    try:
        [worker] = [w for w in app.workers if isinstance(w, FeedbackWorker)]
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


async def records_of(settings: FulmenSettings, key: TopicKey, expected: int, timeout_s: float = 30) -> list[Any]:
    """The first ``expected`` records of topic ``key`` (every partition, from the beginning)."""
    name = topic_name(key, settings.kafka.topic_prefix)
    reader = consumer(settings, None)
    await start_or_raise(reader, settings, "test reader")
    found: list[Any] = []
    try:
        partitions = [TopicPartition(name, p) for p in range(topic(key).partitions)]
        reader.assign(partitions)
        await reader.seek_to_beginning(*partitions)
        async with asyncio.timeout(timeout_s):
            while len(found) < expected:
                for records in (await reader.getmany(timeout_ms=200)).values():
                    found.extend(records)
    finally:
        await close_quietly([reader])
    return found


def rows(store: Store, sql: str) -> list[list[Any]]:
    return store.query(sql.format(db=store.database)).rows


async def test_feedback_on_a_response_a_rollout_and_a_trace_lands_resolved(
    settings: FulmenSettings, linked_store: Store, tiny_model: Path
) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    async with (
        consumers_running(settings, linked_store),
        llm_gateway_running(settings, tiny_model, follow_models=False) as gateway,
        event_publisher(settings) as publisher,
        httpx.AsyncClient(timeout=30) as http,
    ):
        await publisher.publish_many(
            TopicKey.ROLLOUTS,
            [
                ended("r-fb", RolloutStatus.FAILED, attempt=1),
                ended("r-fb", attempt=2, reward=0.0),
            ],
        )
        client = AsyncOpenAI(
            base_url=base_url(gateway, "r-fb", attempt=2),
            api_key="x",
            max_retries=0,
            default_headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
        )
        call = await client.chat.completions.create(
            model="fulmen", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        # at once: the call's span may not be in the store yet (the consumer looks again until it is)
        sent = {}
        for body in (
            {"response_id": call.id, "value": 0.5, "comment": "helpful"},
            {"rollout_id": "r-fb", "value": 1.0},
            {"trace_id": trace_id, "value": -1, "name": "safety"},
        ):
            answer = await http.post(f"http://127.0.0.1:{gateway.port}/v1/feedback", json=body)
            assert answer.status_code == 202, answer.text
            sent[next(iter(body))] = answer.json()["feedback_id"]
        count = await count_reaches(linked_store, f"SELECT count() FROM {linked_store.database}.feedback", 3)
        assert count == 3
    [[span_id]] = rows(linked_store, f"SELECT SpanId FROM {{db}}.otel_traces WHERE TraceId = '{trace_id}'")
    stored = rows(
        linked_store,
        "SELECT FeedbackId, Target, TargetId, RolloutId, Attempt, TraceId, SpanId, Name, Value, "
        "Comment, Source FROM {db}.feedback FINAL ORDER BY Target",
    )
    assert stored == [
        [sent["response_id"], "response", call.id, "r-fb", 2, trace_id, span_id, "reward", 0.5, "helpful", "api"],
        [sent["rollout_id"], "rollout", "r-fb", "r-fb", 2, "", "", "reward", 1.0, "", "api"],  # its latest attempt
        [sent["trace_id"], "trace", trace_id, "r-fb", 2, trace_id, "", "safety", -1.0, "", "api"],
    ]
    # the call's span is the one the transitions are built from: the gateway's, with the call's token ids
    [[tokens]] = rows(
        linked_store, f"SELECT length(ResponseTokenIds) FROM {{db}}.otel_traces WHERE SpanId = '{span_id}'"
    )
    assert tokens > 0


def feedback(minutes_ago: float, value: float, **fields: Any) -> Feedback:
    when = datetime.now(UTC) - timedelta(minutes=minutes_ago)
    return Feedback(**{"target": "rollout", "target_id": "r-1", "value": value, "timestamp": when} | fields)


async def test_every_feedback_is_kept_and_the_latest_wins_per_call_and_episode(
    settings: FulmenSettings, linked_store: Store
) -> None:
    raw = producer(settings)
    await start_or_raise(raw, settings)
    call = llm_call("chat", "r-1", 10, attributes={semconv.GEN_AI_RESPONSE_ID: "chatcmpl-kept"})
    try:
        async with (
            consumers_running(settings, linked_store) as worker,
            event_publisher(settings, sender=SENDER) as publisher,
        ):
            await produce_spans(raw, settings, [call])
            async with event_publisher(settings) as events:
                await events.publish(TopicKey.ROLLOUTS, ended("r-1"))
            # the latest by timestamp wins, whatever order they arrive in; other names do not compete
            latest = feedback(1, 0.9)
            await publisher.publish(TopicKey.FEEDBACK, latest)
            await publisher.publish(TopicKey.FEEDBACK, feedback(5, 0.1))
            await publisher.publish(TopicKey.FEEDBACK, feedback(0, 7.0, name="length"))
            await publisher.publish(TopicKey.FEEDBACK, feedback(3, -1.0, target="response", target_id="chatcmpl-kept"))
            await publisher.publish(TopicKey.FEEDBACK, feedback(2, 1.0, target="response", target_id="chatcmpl-kept"))
            await publisher.publish(TopicKey.FEEDBACK, latest)  # delivered twice (a producer's retry)
            async with asyncio.timeout(30):
                while worker.stats.resolved < 6:
                    await asyncio.sleep(0.05)
    finally:
        await close_quietly([raw])
    assert rows(linked_store, "SELECT count() FROM {db}.feedback FINAL") == [[5]]  # the duplicate is one row
    assert rows(linked_store, LATEST) == [["r-1", "", 0.9], ["r-1", call.span_id, 1.0]]


async def test_an_unknown_target_is_dead_lettered_with_the_reason_after_the_grace(
    settings: FulmenSettings, linked_store: Store
) -> None:
    raw = producer(settings)
    await start_or_raise(raw, settings)
    unknown, late = (
        Feedback(target="response", target_id="chatcmpl-nowhere", value=1.0),
        feedback(0, 0.5, target="response", target_id="chatcmpl-late"),
    )
    try:
        async with (
            consumers_running(settings, linked_store, grace_s=2.0),
            event_publisher(settings, sender=SENDER) as publisher,
        ):
            await publisher.publish_many(TopicKey.FEEDBACK, [unknown, late])
            await asyncio.sleep(1.0)  # the late call's span arrives after its feedback, within the grace
            call = llm_call("chat", "r-late", 10, attributes={semconv.GEN_AI_RESPONSE_ID: "chatcmpl-late"})
            await produce_spans(raw, settings, [call])
            [record] = await records_of(settings, TopicKey.DLQ, 1)
            assert await count_reaches(linked_store, f"SELECT count() FROM {linked_store.database}.feedback", 1) == 1
    finally:
        await close_quietly([raw])
    headers = DeadLetterHeaders.from_kafka(record.headers)
    assert headers.error_type == "UnknownTargetError"
    assert "no LLM call with response id chatcmpl-nowhere in the store" in headers.error
    assert headers.source_topic == topic_name(TopicKey.FEEDBACK, settings.kafka.topic_prefix)
    assert decode(Feedback, record.value) == unknown and record.key == b"chatcmpl-nowhere"  # kept whole, to replay
    assert headers.failed_at - unknown.timestamp >= timedelta(seconds=2.0)  # not before the grace was over
    assert rows(linked_store, "SELECT TargetId, RolloutId, SpanId FROM {db}.feedback") == [
        ["chatcmpl-late", "r-late", call.span_id]
    ]


async def test_the_endpoint_needs_the_token_and_answers_400_with_the_reason(
    settings: FulmenSettings, tiny_model: Path
) -> None:
    async with (
        llm_gateway_running(settings, tiny_model, follow_models=False, bearer_token="s3cret") as gateway,
        httpx.AsyncClient(timeout=30) as http,
    ):
        url = f"http://127.0.0.1:{gateway.port}/v1/feedback"
        good = {"response_id": "chatcmpl-1", "value": 1}
        assert (await http.post(url, json=good)).status_code == 401
        assert (await http.post(url, json=good, headers={"Authorization": "Bearer wrong"})).status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        bad = [
            ({"value": 1}, None, "exactly one of response_id, rollout_id or trace_id"),
            ({"response_id": "a", "rollout_id": "b", "value": 1}, "rollout_id", "exactly one of"),
            ({"rollout_id": "r1", "value": "1"}, "value", "must be a number"),
            ({"rollout_id": "r1", "value": 1, "name": "a b"}, "name", "pattern"),
            ({"trace_id": "not-hex", "value": 1}, "trace_id", "32 lowercase hex"),
            ({"rollout_id": "r1", "value": 1, "extra": True}, "extra", "unknown field"),
        ]
        for body, param, words in bad:
            answer = await http.post(url, json=body, headers=auth)
            error = answer.json()["error"]
            assert (answer.status_code, error["param"]) == (400, param), answer.text
            assert words in error["message"]
        raws = [
            (b'{"rollout_id": "r1", "value": 1e999}', "too large"),
            (b'{"rollout_id": "r1", "value": NaN}', "NaN"),
            (b"not json", "not valid JSON"),
            (b"[1]", "JSON object"),
        ]
        for raw, words in raws:
            answer = await http.post(url, content=raw, headers=auth | {"Content-Type": "application/json"})
            assert answer.status_code == 400 and words in answer.json()["error"]["message"], answer.text
        answer = await http.post(url, json={**good, "comment": "x" * 70_000}, headers=auth)
        assert answer.status_code == 413
        answer = await http.post(url, json={"trace_id": "ab" * 16, "value": 0.25, "comment": "late"}, headers=auth)
        assert answer.status_code == 202
        feedback_id = answer.json()["feedback_id"]
    [record] = await records_of(settings, TopicKey.FEEDBACK, 1)
    event = decode(Feedback, record.value)
    assert (event.feedback_id, event.target, event.value, event.source) == (feedback_id, "trace", 0.25, "api")
    assert record.key == b"ab" * 16 and (datetime.now(UTC) - event.timestamp) < timedelta(minutes=1)


async def test_feedback_kafka_does_not_take_is_a_503(settings: FulmenSettings, tiny_model: Path) -> None:
    gateway = LlmGateway(llm_settings(settings, tiny_model, follow_models=False), kafka_producer=_DeadProducer())  # type: ignore[arg-type]
    await gateway.start()
    try:
        async with httpx.AsyncClient() as http:
            answer = await http.post(
                f"http://127.0.0.1:{gateway.port}/v1/feedback", json={"rollout_id": "r", "value": 1}
            )
    finally:
        await gateway.stop()
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "1"
    assert "the feedback could not be recorded in Kafka" in answer.json()["error"]["message"]


def run_cli(args: list[str], settings: FulmenSettings) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {
        "FULMEN_KAFKA_BOOTSTRAP": settings.bootstrap,
        "FULMEN_KAFKA_TOPIC_PREFIX": settings.kafka.topic_prefix,
        "FULMEN_HOME": str(settings.home),
        "COLUMNS": "200",
    }
    return subprocess.run(
        [sys.executable, "-m", "fulmen.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_the_feedback_command_publishes_and_refuses_two_targets(settings: FulmenSettings) -> None:
    started = time.monotonic()
    done = await asyncio.to_thread(
        run_cli, ["feedback", "--rollout-id", "r-7", "--value", "-0.5", "--comment", "from the CLI"], settings
    )
    assert done.returncode == 0, done.stdout + done.stderr
    feedback_id = done.stdout.strip()
    refused = await asyncio.to_thread(
        run_cli, ["feedback", "--rollout-id", "r-7", "--trace-id", "ab" * 16, "--value", "1"], settings
    )
    assert refused.returncode == 1
    assert "give exactly one of --response-id, --rollout-id or --trace-id" in refused.stderr
    [record] = await records_of(settings, TopicKey.FEEDBACK, 1)
    event = decode(Feedback, record.value)
    assert (event.feedback_id, event.target_id, event.value, event.source) == (feedback_id, "r-7", -0.5, "cli")
    assert json.loads(record.value)["comment"] == "from the CLI" and time.monotonic() - started < 120
