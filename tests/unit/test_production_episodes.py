"""Production episodes against fakes: which spans are production calls, when a trace's episode ends (a fake clock),
what its end says, and that a span record is committed only once every episode it holds has ended."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.structs import TopicPartition

from fulmen.consumers.production import (
    OpenEpisodes,
    ProductionEpisodesSink,
    ProductionSection,
    ProductionWorker,
    scan_record,
)
from fulmen.infra.kafka.publish import EventPublisher
from fulmen.producers.llm_gateway.backends.base import CallResult, Choice
from fulmen.producers.llm_gateway.spans import CallContext, TraceParent, build_record
from fulmen.schemas import RolloutEvent, RolloutMode, RolloutStatus, semconv
from fulmen.schemas.codec import decode
from fulmen.schemas.errors import RetryableError
from tests.fakes import FakeBroker, FakeProducer, PausingConsumer

pytestmark = pytest.mark.continuous

SPANS = "otlp_spans"
P0, P1 = TopicPartition(SPANS, 0), TopicPartition(SPANS, 1)
TRACE_A, TRACE_B = "a" * 31 + "1", "b" * 31 + "2"


def gateway_record(trace_id: str | None, rollout_id: str | None = None, token_ids: bool = True) -> tuple[bytes, bytes]:
    """The record the LLM gateway publishes for one call (the plain endpoint when ``rollout_id`` is None)."""
    parent = TraceParent(bytes.fromhex(trace_id), bytes.fromhex("1" * 16)) if trace_id else None
    call = CallContext(
        semconv.OPERATION_CHAT,
        {"model": "tiny", "messages": []},
        "fulmen",
        1,
        2,
        parent=parent,
        rollout_id=rollout_id,
        attempt=1 if rollout_id else None,
    )
    ids = [5, 6] if token_ids else None
    result = CallResult(
        "chatcmpl-1",
        "tiny",
        [Choice(0, "hi", "stop", ids, None)],
        [1, 2, 3] if token_ids else None,
        3,
        2,
        token_ids_absent=None if token_ids else "an openai upstream",
    )
    return build_record(call, result)


# --- which spans are production calls ---------------------------------------------------------------------------
def test_a_call_without_rollout_id_is_a_production_call_of_its_trace() -> None:
    key, value = gateway_record(TRACE_A)
    assert key == TRACE_A.encode()
    assert scan_record(key, value).calls == (TRACE_A,)
    assert scan_record(key, value).key_trace == TRACE_A
    assert scan_record(*gateway_record(TRACE_A, rollout_id="r-1")).calls == ()  # a rollout's call
    assert scan_record(*gateway_record(TRACE_A, token_ids=False)).calls == ()  # nothing to train on
    fresh_key, fresh = gateway_record(None)  # no traceparent: the gateway starts a trace of its own
    assert scan_record(fresh_key, fresh).calls == (fresh_key.decode(),)


def test_records_that_cannot_hold_a_call_are_not_parsed_and_garbage_is_nothing() -> None:
    assert scan_record(b"not a trace id", b"\x0a\x02no tokens here") == scan_record(None, None)
    garbage = b"\xff" + semconv.PROMPT_TOKEN_IDS.encode() + b"\xff"
    assert scan_record(TRACE_B.encode(), garbage).calls == ()  # the spans consumer dead-letters it
    assert scan_record(TRACE_B.encode(), garbage).key_trace == TRACE_B
    assert scan_record(("0" * 32).encode(), None).key_trace is None


# --- when an episode ends ---------------------------------------------------------------------------------------
def test_an_episode_ends_once_its_trace_has_been_idle_for_idle_s() -> None:
    now = [0.0]
    episodes = OpenEpisodes(idle_s=1.0, clock=lambda: now[0])
    episodes.call(TRACE_A, (P0, 0))
    now[0] = 0.6
    episodes.call(TRACE_A, (P0, 1))  # a second call restarts the idle time
    episodes.call(TRACE_B, (P0, 1))  # one record may hold calls of two traces
    assert episodes.next_end() == pytest.approx(1.6)
    now[0] = 1.5
    assert episodes.idle() == []
    assert episodes.touch(TRACE_A) and not episodes.touch("c" * 32)  # another span of A; C is no episode
    now[0] = 1.6
    assert [e.trace_id for e in episodes.idle()] == [TRACE_B]  # A was seen at 1.5
    assert episodes.close([TRACE_B]) == []  # record 1 still holds A's call
    assert episodes.held((P0, 1)) and len(episodes) == 1
    now[0] = 2.5
    [ended] = episodes.idle()
    assert (ended.trace_id, ended.opened_at, ended.last_seen, ended.records) == (TRACE_A, 0.0, 1.5, {(P0, 0), (P0, 1)})
    assert sorted(episodes.close([TRACE_A])) == [(P0, 0), (P0, 1)]
    assert len(episodes) == 0 and episodes.next_end() is None and not episodes.held((P0, 0))
    episodes.call(TRACE_A, (P0, 7))  # a call after the end opens the trace again
    assert TRACE_A in episodes and episodes.idle() == []


def test_a_revoked_partition_takes_away_what_its_records_told() -> None:
    episodes = OpenEpisodes(idle_s=1.0, clock=lambda: 0.0)
    episodes.call(TRACE_A, (P0, 0))
    episodes.call(TRACE_B, (P0, 1))
    episodes.call(TRACE_B, (P1, 0))
    assert episodes.forget([P0]) == [TRACE_A]  # B still has a record on P1
    assert TRACE_B in episodes and not episodes.held((P0, 1)) and episodes.held((P1, 0))
    assert episodes.close([TRACE_B]) == [(P1, 0)]


def test_idle_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match="idle_s"):
        OpenEpisodes(idle_s=0)
    with pytest.raises(ValueError):
        ProductionSection(idle_s=0)


# --- the worker: ends published, commits held back until then ---------------------------------------------------
class FlakyProducer(FakeProducer):
    def __init__(self, events: list[str], failures: int = 0) -> None:
        super().__init__(events)
        self.failures = failures
        self.on_failure = lambda: None

    async def send(self, topic: str, value: bytes | None = None, key: bytes | None = None, headers: Any = None):
        if self.failures:
            self.failures -= 1
            self.on_failure()
            raise RetryableError("broker down (fake)")
        return await super().send(topic, value, key, headers)


def build(
    failures: int = 0, max_open: int = 100
) -> tuple[ProductionWorker, PausingConsumer, FlakyProducer, list[float]]:
    consumer = PausingConsumer()
    producer = FlakyProducer(consumer.events, failures)
    now = [0.0]
    section = ProductionSection(idle_s=1.0, max_open=max_open)
    worker = ProductionWorker(
        ProductionEpisodesSink(section),
        None,
        consumer,
        EventPublisher(FakeBroker(producer)),
        section,  # type: ignore[arg-type]
        retry_backoff_s=0.001,
        clock=lambda: now[0],
    )
    return worker, consumer, producer, now


def ends(producer: FakeProducer) -> list[RolloutEvent]:
    return [decode(RolloutEvent, sent["value"]) for sent in producer.sent if sent["topic"] == "fulmen.rollouts"]


async def test_a_trace_ends_as_one_production_rollout_and_its_records_are_committed_then() -> None:
    worker, consumer, producer, now = build()
    stop = asyncio.Event()
    consumer.append(SPANS, 0, *reversed(gateway_record(TRACE_A)))  # offset 0: a production call
    consumer.append(SPANS, 0, *reversed(gateway_record(TRACE_B, rollout_id="r-1")))  # 1: a rollout's call
    await worker.poll_once(stop)
    assert ends(producer) == [] and consumer.committed == {}  # offset 0 waits for its episode
    now[0] = 0.5
    consumer.append(SPANS, 0, *reversed(gateway_record(TRACE_A)))  # 2: A's second call
    await worker.poll_once(stop)
    now[0] = 1.4
    await worker.poll_once(stop)
    assert ends(producer) == []
    now[0] = 1.5
    await worker.poll_once(stop)
    [end] = ends(producer)
    assert (end.rollout_id, end.attempt, end.task_id, end.group_id) == (f"trace-{TRACE_A}", 1, f"trace-{TRACE_A}", "")
    assert (end.mode, end.status, end.reward) == (RolloutMode.PRODUCTION, RolloutStatus.SUCCEEDED, None)
    assert producer.sent[0]["key"] == f"trace-{TRACE_A}".encode()
    assert consumer.committed == {P0: 3}  # only after the end was acknowledged
    assert (worker.stats.records, worker.stats.calls, worker.stats.ended) == (3, 2, 1)


async def test_an_end_the_broker_does_not_take_is_retried_and_nothing_is_committed_meanwhile() -> None:
    worker, consumer, producer, now = build(failures=2)
    stop = asyncio.Event()
    consumer.append(SPANS, 0, *reversed(gateway_record(TRACE_A)))
    await worker.poll_once(stop)
    now[0] = 2.0
    await worker.poll_once(stop)
    assert [e.rollout_id for e in ends(producer)] == [f"trace-{TRACE_A}"] and consumer.committed == {P0: 1}

    worker, consumer, producer, now = build(failures=10**6)
    consumer.append(SPANS, 0, *reversed(gateway_record(TRACE_A)))
    await worker.poll_once(stop)
    now[0] = 2.0
    producer.on_failure = stop.set  # stopped while the broker refuses
    await worker.poll_once(stop)
    assert ends(producer) == [] and consumer.committed == {}  # read again after a restart
    assert len(worker.episodes) == 1 and worker.stats.ended == 0


async def test_too_many_open_episodes_pause_fetching_until_some_end() -> None:
    worker, consumer, _, now = build(max_open=1)
    stop = asyncio.Event()
    consumer.append(SPANS, 0, *reversed(gateway_record(TRACE_A)))
    await worker.poll_once(stop)
    consumer.append(SPANS, 0, *reversed(gateway_record(TRACE_B)))
    await worker.poll_once(stop)
    assert consumer.paused() == {P0} and worker.stats.records == 1  # B's call waits in Kafka
    now[0] = 1.0
    await worker.poll_once(stop)  # A ends
    await worker.poll_once(stop)  # resumed: B is read
    assert consumer.paused() == set() and worker.stats.records == 2 and TRACE_B in worker.episodes
