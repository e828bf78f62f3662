"""The transitions consumer against a real broker and the embedded store: rollouts of every shape end as batches."""

from __future__ import annotations

import asyncio

import pytest

from fulmen.algorithm.service.groups import ClosedGroup, credit_groups
from fulmen.algorithm.settings import TrainSettings
from fulmen.consumers.transitions import TransitionsSection
from fulmen.infra.kafka.clients import producer, start_or_raise
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store
from fulmen.schemas import semconv
from fulmen.schemas.events import RolloutStatus, TransitionBatch
from fulmen.schemas.topics import TopicKey, topic_name
from fulmen.testing.publishing import event_publisher
from tests.integration.transition_pipeline import (
    BASE_NS,
    BatchReader,
    FakeSpan,
    builders,
    consumers_running,
    ended,
    llm_call,
    produce_spans,
)
from tests.polling import count_reaches

pytestmark = pytest.mark.integration

SECTION = TransitionsSection(late_window_s=0)


def agent_rollout(rollout: str, calls: int = 3, *, attempt: int = 1, agent: str = "solver") -> list[FakeSpan]:
    """The runner's span, an agent span, ``calls`` LLM calls nested under it, and a reward after the first."""
    spans = [
        FakeSpan(semconv.SPAN_ROLLOUT, rollout, attempt, start_ms=0, end_ms=1000),
        FakeSpan(
            "invoke_agent",
            rollout,
            attempt,
            parent=semconv.SPAN_ROLLOUT,
            start_ms=1,
            end_ms=999,
            attributes={semconv.GEN_AI_AGENT_NAME: agent},
        ),
        FakeSpan(
            semconv.SPAN_REWARD,
            rollout,
            attempt,
            parent="invoke_agent",
            start_ms=95,
            end_ms=95,
            attributes={semconv.REWARD_VALUE: 0.25},
        ),
    ]
    for i in range(calls):
        spans.append(llm_call(f"call-{i}", rollout, 10 + 100 * i, attempt=attempt, parent="invoke_agent"))
    return spans


@pytest.fixture
async def kafka(settings: FulmenSettings):  # type: ignore[no-untyped-def]
    client = producer(settings)
    await start_or_raise(client, settings)
    try:
        async with event_publisher(settings) as publisher:
            yield client, publisher
    finally:
        await client.stop()


def by_rollout(batches: list[TransitionBatch]) -> dict[tuple[str, int], TransitionBatch]:
    return {(b.rollout_id, b.attempt): b for b in batches}


async def test_a_rollout_becomes_one_batch_and_one_row_per_call(
    settings: FulmenSettings, linked_store: Store, kafka: tuple
) -> None:
    client, publisher = kafka
    spans = agent_rollout("r1", calls=3)
    async with consumers_running(settings, linked_store, SECTION), BatchReader(settings) as reader:
        await produce_spans(client, settings, spans)
        await publisher.publish(TopicKey.ROLLOUTS, ended("r1", reward=0.5))
        (batch,) = await reader.until(1)
    assert reader.keys == [b"g1"]  # keyed by group
    assert (batch.status, batch.episode_reward, batch.group_id, batch.task_id) == ("succeeded", 0.5, "g1", "task-r1")
    calls = [s for s in spans if s.name.startswith("call-")]
    assert [t.span_id for t in batch.transitions] == [c.span_id for c in calls]
    assert [t.prompt_token_ids for t in batch.transitions] == [c.attributes[semconv.PROMPT_TOKEN_IDS] for c in calls]
    assert [t.response_token_ids for t in batch.transitions] == [[12, 9], [112, 9], [212, 9]]
    assert [t.response_logprobs for t in batch.transitions] == [[-0.5, -0.25]] * 3
    assert [(t.reward, t.intermediate_reward) for t in batch.transitions] == [(None, 0.25), (None, None), (None, None)]
    assert {(t.agent_name, t.model_version) for t in batch.transitions} == {("solver", 2)}
    db = linked_store.database
    rows = linked_store.query(
        f"SELECT CallIndex, SpanId, Reward, IntermediateReward, EpisodeReward FROM {db}.transitions "
        "WHERE RolloutId = 'r1' ORDER BY CallIndex"
    ).rows
    assert rows == [
        [i, c.span_id, None, 0.25 if i == 0 else None, 0.5] for i, c in enumerate(calls)
    ]  # credit: by the run


async def test_no_llm_call_failed_and_poison(settings: FulmenSettings, linked_store: Store, kafka: tuple) -> None:
    client, publisher = kafka
    section = TransitionsSection(late_window_s=0)
    async with consumers_running(settings, linked_store, section) as app, BatchReader(settings) as reader:
        await produce_spans(client, settings, agent_rollout("no-calls", calls=0) + agent_rollout("broken", calls=2))
        rollouts = f"{settings.kafka.topic_prefix}fulmen.rollouts"
        await client.send_and_wait(rollouts, b'{"rollout_id": "x"}', key=b"x")
        await publisher.publish_many(
            TopicKey.ROLLOUTS,
            [
                ended("no-calls", RolloutStatus.RUNNING),
                ended("no-calls", reward=1.0),
                ended("broken", RolloutStatus.FAILED),
            ],
        )
        batches = by_rollout(await reader.until(2))
        worker = builders(app)[0]
        assert worker.stats.dead_lettered == 1
    empty, failed = batches[("no-calls", 1)], batches[("broken", 1)]
    assert (empty.status, empty.episode_reward, empty.transitions) == ("succeeded", 1.0, [])
    assert failed.status == "failed" and failed.episode_reward is None
    assert [(t.reward, t.intermediate_reward) for t in failed.transitions] == [(None, 0.25), (None, None)]
    db = linked_store.database
    assert linked_store.query(f"SELECT count() FROM {db}.transitions WHERE RolloutId = 'no-calls'").rows == [[0]]


async def test_only_the_latest_attempt_is_used(settings: FulmenSettings, linked_store: Store, kafka: tuple) -> None:
    client, publisher = kafka
    spans = [
        *agent_rollout("raced", calls=2, attempt=1),
        *agent_rollout("raced", calls=1, attempt=2),
        *agent_rollout("retried", calls=2, attempt=1),
        *agent_rollout("retried", calls=3, attempt=2),
    ]
    async with consumers_running(settings, linked_store, SECTION) as app, BatchReader(settings) as reader:
        await produce_spans(client, settings, spans)
        # "raced": attempt 2 was claimed before attempt 1's end was published; attempt 1 is never built.
        await publisher.publish_many(
            TopicKey.ROLLOUTS,
            [
                ended("raced", RolloutStatus.CLAIMED, attempt=2),
                ended("raced", RolloutStatus.FAILED, attempt=1),
                ended("raced", attempt=2, reward=1.0),
            ],
        )
        # "retried": attempt 1 ends (built as failed), then attempt 2 runs and succeeds.
        await publisher.publish(TopicKey.ROLLOUTS, ended("retried", RolloutStatus.FAILED, attempt=1))
        await reader.until(2)
        await publisher.publish(TopicKey.ROLLOUTS, ended("retried", attempt=2, reward=1.0))
        batches = by_rollout(await reader.until(3))
        assert builders(app)[0].stats.superseded == 1
    assert set(batches) == {("raced", 2), ("retried", 1), ("retried", 2)}
    assert len(batches[("raced", 2)].transitions) == 1
    assert (batches[("retried", 1)].status, len(batches[("retried", 1)].transitions)) == ("failed", 2)
    latest = batches[("retried", 2)]
    assert latest.status == "succeeded" and len(latest.transitions) == 3
    expected = [s.span_id for s in agent_rollout("retried", calls=3, attempt=2) if s.name.startswith("call-")]
    assert [t.span_id for t in latest.transitions] == expected


async def test_a_late_span_rebuilds_and_republishes(
    settings: FulmenSettings, linked_store: Store, kafka: tuple
) -> None:
    client, publisher = kafka
    section = TransitionsSection(late_window_s=60, late_check_interval_s=0.2)
    async with consumers_running(settings, linked_store, section) as app, BatchReader(settings) as reader:
        await produce_spans(client, settings, agent_rollout("r1", calls=2))
        await publisher.publish(TopicKey.ROLLOUTS, ended("r1", reward=1.0))
        (first,) = await reader.until(1)
        late = llm_call("call-late", "r1", 500, parent="invoke_agent")
        await produce_spans(client, settings, [late])
        batches = await reader.until(2)
        assert builders(app)[0].stats.late_rebuilds == 1
    assert len(first.transitions) == 2 and len(batches) == 2
    rebuilt = batches[1]
    assert rebuilt.created_at > first.created_at
    assert [t.span_id for t in rebuilt.transitions][-1] == late.span_id and len(rebuilt.transitions) == 3
    db = linked_store.database
    sql = f"SELECT count() FROM {db}.transitions WHERE RolloutId = 'r1'"
    assert linked_store.query(sql).rows == [[3]]


async def test_the_barrier_waits_for_spans_spread_over_partitions(
    settings: FulmenSettings, linked_store: Store, kafka: tuple
) -> None:
    client, publisher = kafka
    # Three traces (the agent's and two LLM gateway traces) on three partitions; the spans consumer starts only
    # after the rollout's end is published, so the builder must wait for it.
    agent = agent_rollout("r1", calls=1)
    gateway = [llm_call(f"gw-{i}", "r1", 300 + 100 * i, trace=f"gw-{i}") for i in range(2)]
    async with consumers_running(settings, linked_store, SECTION, spans=False) as app, BatchReader(settings) as rd:
        for partition, part in enumerate([agent, gateway[:1], gateway[1:]]):
            await produce_spans(client, settings, part, partition=partition)
        await publisher.publish(TopicKey.ROLLOUTS, ended("r1"))
        assert await rd.until(1, timeout_s=3) == []  # nothing is built from a partial set
        async with consumers_running(settings, linked_store, SECTION, builder=False):
            (batch,) = await rd.until(1)
        assert builders(app)[0].stats.batches == 1
    assert [t.span_id for t in batch.transitions] == [agent[3].span_id, gateway[0].span_id, gateway[1].span_id]
    assert {t.agent_name for t in batch.transitions} == {"solver"}  # the gateway traces are grafted in


async def test_two_consumer_processes_share_the_work(
    settings: FulmenSettings, linked_store: Store, kafka: tuple
) -> None:
    client, publisher = kafka
    rollouts = [f"r{i}" for i in range(16)]
    async with (
        consumers_running(settings, linked_store, SECTION) as first,
        consumers_running(settings, linked_store, SECTION) as second,
        BatchReader(settings) as reader,
    ):
        await asyncio.sleep(1)  # let both join their groups before the load starts
        for i, rollout in enumerate(rollouts):
            await produce_spans(client, settings, agent_rollout(rollout, calls=1 + i % 3))
            await publisher.publish(TopicKey.ROLLOUTS, ended(rollout, group=f"g{i % 4}"))
        batches = await reader.until(len(rollouts))
        db = linked_store.database
        await count_reaches(linked_store, f"SELECT count() FROM {db}.transitions", sum(1 + i % 3 for i in range(16)))
        built = [sum(w.stats.batches for w in builders(app)) for app in (first, second)]
    assert {b.rollout_id for b in batches} == set(rollouts)
    for batch in batches:  # every batch is whole, whichever process built it
        assert len(batch.transitions) == 1 + int(batch.rollout_id[1:]) % 3
    assert sum(built) >= len(rollouts)


async def test_the_llm_gateway_s_own_records_become_transitions(
    settings: FulmenSettings, linked_store: Store, kafka: tuple
) -> None:
    from fulmen.producers.llm_gateway.backends.base import CallResult, Choice
    from fulmen.producers.llm_gateway.spans import CallContext, build_record

    client, publisher = kafka
    agent = [
        FakeSpan(semconv.SPAN_ROLLOUT, "r1", start_ms=0, end_ms=1000),
        FakeSpan(
            "invoke_agent",
            "r1",
            parent=semconv.SPAN_ROLLOUT,
            start_ms=1,
            end_ms=999,
            attributes={semconv.GEN_AI_AGENT_NAME: "solver"},
        ),
    ]
    served = [  # one call, then a call with n = 2 (one span per choice), as the gateway records them
        CallResult(
            "chatcmpl-a",
            "tiny",
            [Choice(0, "hi", "stop", [5, 6, 7], [-0.5, -0.25, -0.125])],
            [1, 2, 3],
            3,
            3,
            model_version=4,
        ),
        CallResult(
            "chatcmpl-b",
            "tiny",
            [Choice(0, "x", "stop", [8], [-1.0]), Choice(1, "y", "length", [9, 10], None)],
            [1, 2, 3, 5, 6, 7, 4],
            7,
            3,
            model_version=4,
        ),
    ]
    spans_topic = topic_name(TopicKey.SPANS, settings.kafka.topic_prefix)
    async with consumers_running(settings, linked_store, SECTION), BatchReader(settings) as reader:
        await produce_spans(client, settings, agent)
        for i, result in enumerate(served):
            start = BASE_NS + (100 + 300 * i) * 1_000_000
            context = CallContext(
                "chat",
                {"model": "tiny", "messages": []},
                "fulmen",
                start,
                start + 50_000_000,
                rollout_id="r1",
                attempt=1,
            )
            key, value = build_record(context, result)
            await client.send_and_wait(spans_topic, value, key=key)
        await publisher.publish(TopicKey.ROLLOUTS, ended("r1", reward=1.0))
        (batch,) = await reader.until(1)
    assert [(t.prompt_token_ids, t.response_token_ids) for t in batch.transitions[:1]] == [([1, 2, 3], [5, 6, 7])]
    assert sorted(t.response_token_ids for t in batch.transitions[1:]) == [[8], [9, 10]]
    assert batch.transitions[0].response_logprobs == [-0.5, -0.25, -0.125]  # exact in float32 too
    assert {(t.agent_name, t.model_version) for t in batch.transitions} == {
        ("solver", 4)
    } and batch.episode_reward == 1.0


async def test_two_runs_with_different_credit_share_one_consume_process(
    settings: FulmenSettings, linked_store: Store, kafka: tuple
) -> None:
    """One transitions consumer serves two training runs; each run credits the observed rewards its own way."""
    client, publisher = kafka
    runs = {"run-a": ("discounted", 0.5), "run-b": ("intermediate", 0.5)}
    async with consumers_running(settings, linked_store, SECTION), BatchReader(settings) as reader:
        for run in runs:
            await produce_spans(client, settings, agent_rollout(f"{run}-r1", calls=3))
            await publisher.publish(TopicKey.ROLLOUTS, ended(f"{run}-r1", reward=1.0, group=f"{run}-g1"))
        batches = {b.group_id: b for b in await reader.until(2)}
    credited = {}
    for run, (strategy, gamma) in runs.items():
        train = TrainSettings(train={"run_id": run, "credit": strategy, "gamma": gamma}).train
        batch = batches[f"{run}-g1"]
        group = ClosedGroup(batch.group_id, batch.task_id, batch.mode, 1, (batch,))
        (done,) = credit_groups([group], train.credit, train.gamma)
        credited[run] = [t.reward for t in done.rollouts[0].transitions]
    # observed: R = 1 and a reward of 0.25 after the first of three calls
    assert credited["run-a"] == [0.25, 0.5, 1.0]  # gamma^(T-1-t) * R
    assert credited["run-b"] == pytest.approx([0.25 + 0.5 * 0.5, 0.5, 1.0])  # i_t + gamma * G_{t+1}


async def _feed_ready(app) -> None:  # type: ignore[no-untyped-def]
    worker = builders(app)[0]
    for _ in range(300):
        if worker.feed_ready:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the span feed never covered the spans topic")


async def test_rollouts_claimed_once_the_feed_covers_build_from_it_as_from_the_store(
    settings: FulmenSettings, linked_store: Store, kafka: tuple
) -> None:
    """Rollouts claimed after the feed covers the spans topic are built from what the spans consumer stored, not
    read back; one that was never seen claimed is read back; both give the batch the store gives."""
    from fulmen.consumers.transitions import BuildOptions, build_batch
    from fulmen.consumers.transitions.reader import SpanReader

    client, publisher = kafka
    fed = [f"fed-{i}" for i in range(4)]
    async with consumers_running(settings, linked_store, SECTION) as app, BatchReader(settings) as reader:
        await _feed_ready(app)
        await publisher.publish_many(TopicKey.ROLLOUTS, [ended(r, RolloutStatus.CLAIMED) for r in fed])
        await produce_spans(client, settings, [s for r in [*fed, "unclaimed"] for s in agent_rollout(r, calls=2)])
        ends = [ended(r, reward=1.0) for r in [*fed, "unclaimed"]]
        await publisher.publish_many(TopicKey.ROLLOUTS, ends)
        batches = by_rollout(await reader.until(5))
        worker = builders(app)[0]
        assert (worker.stats.from_feed, worker.stats.from_store) == (4, 1)
        assert worker.feed is not None and len(worker.feed) == 0  # released at their builds
    stored = SpanReader(linked_store).spans([(e.rollout_id, 1) for e in ends])
    for event in ends:
        expected = build_batch(event, stored[(event.rollout_id, 1)], BuildOptions.create(None)).batch
        built = batches[(event.rollout_id, 1)]
        assert built.transitions == expected.transitions and len(built.transitions) == 2


async def test_a_late_span_shows_in_the_feed(settings: FulmenSettings, linked_store: Store, kafka: tuple) -> None:
    """A rollout built from the feed learns of its late span from the feed, without asking the store."""
    client, publisher = kafka
    section = TransitionsSection(late_window_s=60, late_check_interval_s=0.2)
    async with consumers_running(settings, linked_store, section) as app, BatchReader(settings) as reader:
        await _feed_ready(app)
        await publisher.publish(TopicKey.ROLLOUTS, ended("r1", RolloutStatus.CLAIMED))
        await produce_spans(client, settings, agent_rollout("r1", calls=2))
        await publisher.publish(TopicKey.ROLLOUTS, ended("r1", reward=1.0))
        (first,) = await reader.until(1)
        late = llm_call("call-late", "r1", 500, parent="invoke_agent")
        await produce_spans(client, settings, [late])
        batches = await reader.until(2)
        worker = builders(app)[0]
        assert (worker.stats.late_rebuilds, worker.stats.from_feed) == (1, 1)
        assert worker.late._since_ms is None  # the store's late-span check never ran
    assert len(first.transitions) == 2 and [t.span_id for t in batches[1].transitions][-1] == late.span_id


async def test_rollouts_the_feed_dropped_for_room_are_read_back(
    settings: FulmenSettings, linked_store: Store, kafka: tuple
) -> None:
    from fulmen.consumers.transitions.feed import SpanFeed

    client, publisher = kafka
    rollouts = [f"big-{i}" for i in range(3)]
    feed = SpanFeed(max_bytes=1)  # every stored batch overflows it
    async with consumers_running(settings, linked_store, SECTION, feed=feed) as app, BatchReader(settings) as reader:
        await _feed_ready(app)
        await publisher.publish_many(TopicKey.ROLLOUTS, [ended(r, RolloutStatus.CLAIMED) for r in rollouts])
        await produce_spans(client, settings, [s for r in rollouts for s in agent_rollout(r, calls=1)])
        await publisher.publish_many(TopicKey.ROLLOUTS, [ended(r) for r in rollouts])
        batches = by_rollout(await reader.until(3))
        worker = builders(app)[0]
        assert (worker.stats.from_feed, worker.stats.from_store) == (0, 3) and feed.evictions >= 3
    assert all(len(batches[(r, 1)].transitions) == 1 for r in rollouts)
