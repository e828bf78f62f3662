"""Agents in production against a real broker and the embedded store: an agent that Fulmen does not run calls the
LLM gateway's plain endpoint; its calls are grouped by trace into one production rollout once the trace is idle, built
into transitions, scored by feedback on the trace, and picked up by replay with that feedback as its reward."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from openai import AsyncOpenAI

from fulmen.algorithm.service.replay import load_replay
from fulmen.consumers import ConsumerOptions, ConsumersApp, default_sinks
from fulmen.consumers.feedback import FeedbackSection, FeedbackSink
from fulmen.consumers.production import ProductionEpisodesSink, ProductionSection, ProductionWorker
from fulmen.consumers.transitions import TransitionBuilderSink, TransitionsSection
from fulmen.infra.kafka.clients import close_quietly, producer, start_or_raise
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store
from fulmen.schemas import RolloutMode, semconv
from fulmen.testing.llm_pipeline import base_url, llm_gateway_running
from tests.integration.transition_pipeline import FakeSpan, llm_call, produce_spans
from tests.polling import count_reaches

pytestmark = [pytest.mark.integration, pytest.mark.continuous]

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLS = "SELECT CallIndex, SpanId, IntermediateReward, EpisodeReward FROM {db}.transitions FINAL ORDER BY CallIndex"


@asynccontextmanager
async def consumers_running(
    settings: FulmenSettings, store: Store, idle_s: float, *, all_sinks: bool = True, late_window_s: float = 0
) -> AsyncIterator[ProductionWorker]:
    """``fulmen consume`` with the production detector (and, unless ``all_sinks`` is False, every other sink);
    yields the detector's worker."""
    production = ProductionEpisodesSink(ProductionSection(idle_s=idle_s))
    transitions = TransitionsSection(late_window_s=late_window_s, late_check_interval_s=0.2)
    others = (
        [
            *default_sinks(),
            TransitionBuilderSink(transitions),
            FeedbackSink(FeedbackSection(retry_first_s=0.1, retry_max_s=0.5)),
        ]
        if all_sinks
        else []
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    app = ConsumersApp(settings, store, [*others, production], ConsumerOptions(max_wait_s=0.1))
    task = asyncio.create_task(app.run(stop, ready))
    await asyncio.wait_for(ready.wait(), 60)
    try:
        [worker] = [w for w in app.workers if isinstance(w, ProductionWorker)]
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


def rows(store: Store, sql: str) -> list[list[Any]]:
    return store.query(sql.format(db=store.database)).rows


async def test_an_agent_in_production_becomes_a_rollout_that_feedback_makes_trainable_by_replay(
    settings: FulmenSettings, linked_store: Store, tiny_model: Path
) -> None:
    rollout_id = f"trace-{TRACE_ID}"
    db = linked_store.database
    async with (
        consumers_running(settings, linked_store, idle_s=1.0) as detector,
        llm_gateway_running(settings, tiny_model, follow_models=False) as gateway,
        httpx.AsyncClient(timeout=30) as http,
    ):
        # an agent of its own: the plain endpoint, its trace propagated; no runner, no rollout id
        agent = AsyncOpenAI(
            base_url=base_url(gateway),
            api_key="x",
            max_retries=0,
            default_headers={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"},
        )
        calls = []
        for question in ("hi", "and then?"):
            calls.append(
                await agent.chat.completions.create(
                    model="fulmen",
                    messages=[{"role": "user", "content": question}],
                    max_tokens=3,
                )
            )
        built = f"SELECT count() FROM {db}.transitions FINAL WHERE RolloutId = '{rollout_id}'"
        assert await count_reaches(linked_store, built, 2, timeout_s=60) == 2
        # one end, or two when the machine took longer than idle_s between the calls: then the trace opened again
        # and its rollout was built again with both calls (the same rollout, one row per call either way)
        assert detector.stats.ended >= 1
        for body in ({"trace_id": TRACE_ID, "value": 0.75}, {"response_id": calls[1].id, "value": -0.5}):
            answer = await http.post(f"http://127.0.0.1:{gateway.port}/v1/feedback", json=body)
            assert answer.status_code == 202, answer.text
        stored = f"SELECT count() FROM {db}.feedback WHERE RolloutId = '{rollout_id}'"
        assert await count_reaches(linked_store, stored, 2) == 2
    assert rows(
        linked_store,
        "SELECT RolloutId, Attempt, TaskId, GroupId, Mode, Status, Reward FROM {db}.rollouts "
        "FINAL WHERE Mode = 'production'",
    ) == [[rollout_id, 1, rollout_id, "", "production", "succeeded", None]]
    transitions = rows(
        linked_store,
        "SELECT CallIndex, TraceId, SpanId, GroupId, length(ResponseTokenIds) > 0 FROM "
        "{db}.transitions FINAL ORDER BY CallIndex",
    )
    assert [t[:2] for t in transitions] == [[0, TRACE_ID], [1, TRACE_ID]]
    assert all(group == "" and tokens for _, _, _, group, tokens in transitions)
    second_call = transitions[1][2]
    assert rows(
        linked_store,
        "SELECT Target, RolloutId, Attempt, TraceId, SpanId, Value FROM {db}.feedback FINAL ORDER BY Target",
    ) == [
        ["response", rollout_id, 1, TRACE_ID, second_call, -0.5],
        ["trace", rollout_id, 1, TRACE_ID, "", 0.75],
    ]
    # replay's loader picks it up: the trace's feedback is its episode reward, the response's that call's reward
    buffer = load_replay(
        linked_store,
        f"SELECT RolloutId FROM {db}.rollouts WHERE Mode = 'production'",
        database=db,
        model_name="fulmen",
        base_model="",
        vocab_size=None,
        group_size=4,
    )
    [group] = buffer.groups
    [episode] = group.rollouts
    assert (episode.rollout_id, episode.mode, episode.episode_reward) == (rollout_id, RolloutMode.PRODUCTION, 0.75)
    assert [t.intermediate_reward for t in episode.transitions] == [None, -0.5] and buffer.feedback_applied == 2
    assert group.group_id.startswith("replay-batch")  # no group: cut into batches with the other loose rollouts


async def produce(settings: FulmenSettings, spans: Sequence[FakeSpan]) -> None:
    raw: AIOKafkaProducer = producer(settings)
    await start_or_raise(raw, settings)
    try:
        await produce_spans(raw, settings, spans)
    finally:
        await close_quietly([raw])


async def test_an_open_episode_survives_a_restart_and_a_late_reward_span_rebuilds_it(
    settings: FulmenSettings, linked_store: Store
) -> None:
    # spans with an empty rollout id (as none), one trace: two calls, then the agent's own reward span, late
    calls = [llm_call("plan", "", 10, trace="prod"), llm_call("answer", "", 30, trace="prod")]
    judge = FakeSpan("judge", "", trace="prod", start_ms=50, end_ms=51, attributes={semconv.REWARD_VALUE: 1.0})
    trace_id = calls[0].ids()[0].hex()
    async with consumers_running(settings, linked_store, idle_s=30.0, all_sinks=False) as detector:
        await produce(settings, calls)
        async with asyncio.timeout(30):
            while detector.stats.calls < 2:
                await asyncio.sleep(0.05)
        assert detector.stats.committed == {}  # the episode is open: its record stays uncommitted
    # stopped before the trace went idle (as if killed): a new process reads the record again, ends the episode
    async with consumers_running(settings, linked_store, idle_s=1.0, late_window_s=30) as detector:
        built = f"SELECT count() FROM {linked_store.database}.transitions FINAL WHERE RolloutId = 'trace-{trace_id}'"
        assert await count_reaches(linked_store, built, 2, timeout_s=60) == 2
        assert rows(linked_store, CALLS) == [[0, calls[0].span_id, None, None], [1, calls[1].span_id, None, None]]
        await produce(settings, [judge])  # within the rollout's late window: found, the rollout built again
        rewarded = f"SELECT count() FROM {linked_store.database}.transitions FINAL WHERE IntermediateReward = 1"
        assert await count_reaches(linked_store, rewarded, 1, timeout_s=30) == 1
    assert detector.stats.ended == 1 and detector.stats.committed
    assert rows(linked_store, CALLS) == [[0, calls[0].span_id, None, None], [1, calls[1].span_id, 1.0, None]]
