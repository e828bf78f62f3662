"""Late feedback without services: the event's validation, the request that becomes one, and the feedback worker's
policy (look again until the grace, wait for the other consumers, dead-letter, commit) against in-memory fakes."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from aiokafka.structs import TopicPartition

from fulmen.consumers.feedback import FeedbackSection, FeedbackSink, FeedbackWorker, Resolved
from fulmen.infra.kafka.dlq import DeadLetters
from fulmen.producers.feedback import FeedbackRequestError, feedback_from
from fulmen.schemas import DeadLetterHeaders, DecodeError, Feedback, FeedbackTarget, decode, decode_obj, encode
from tests.fakes import FakeConsumer, FakeProducer, FakeStore
from tests.unit.test_transition_worker import FakeBarrier

pytestmark = pytest.mark.continuous

TOPIC = "fulmen.feedback"
TP = TopicPartition(TOPIC, 0)
NOW = 1_800_000_000.0  # the fake clock's start (seconds since the epoch)


# --- the event ------------------------------------------------------------------------------------------------
def test_a_feedback_round_trips_keyed_by_its_target() -> None:
    feedback = Feedback(target=FeedbackTarget.TRACE, target_id="ab" * 16, value=-0.5, name="thumbs", comment="é ✓")
    assert decode(Feedback, encode(feedback)) == feedback
    assert (feedback.name, feedback.source, len(feedback.feedback_id)) == ("thumbs", "", 32)
    assert Feedback(target="response", target_id="chatcmpl-1", value=1).name == "reward"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"value": float("nan")}, "finite number"),
        ({"value": float("inf")}, "finite number"),
        ({"value": "high"}, "valid number"),
        ({"name": "has space"}, "pattern"),
        ({"name": "x" * 129}, "at most 128"),
        ({"comment": "x" * 4097}, "at most 4096"),
        ({"target": "call"}, "'response'"),
        ({"target_id": ""}, "at least 1"),
        ({"target_id": "x" * 257}, "at most 256"),
        ({"target_id": "has space"}, "no spaces or control characters"),
        ({"target_id": "line\nbreak"}, "no spaces or control characters"),
        ({"target": "trace", "target_id": "AB" * 16}, "32 lowercase hex"),
        ({"target": "trace", "target_id": "ab" * 15}, "32 lowercase hex"),
        ({"target": "trace", "target_id": "0" * 32}, "not all zero"),
        ({"target": "rollout", "target_id": "r/1"}, "a rollout id"),
        ({"score": 1}, "Extra inputs"),
        ({"schema_version": 2}, "knows version 1"),
    ],
)
def test_invalid_feedback_is_refused_naming_why(change: dict, words: str) -> None:
    good = {"target": "response", "target_id": "chatcmpl-1", "value": 1.0}
    with pytest.raises(DecodeError, match=words):
        decode_obj(Feedback, good | change)


# --- the request (the gateway's body, the command's options) ---------------------------------------------------
def test_a_request_becomes_a_feedback_from_its_source() -> None:
    feedback = feedback_from({"rollout_id": "r-1", "value": 2, "comment": "late", "trace_id": None}, source="api")
    assert (feedback.target, feedback.target_id, feedback.value, feedback.comment) == ("rollout", "r-1", 2.0, "late")
    assert (feedback.name, feedback.source) == ("reward", "api")


@pytest.mark.parametrize(
    ("request_", "param", "words"),
    [
        ([1], None, "JSON object"),
        ({"value": 1}, None, r"exactly one of response_id, rollout_id or trace_id \(got none\)"),
        ({"response_id": "x", "trace_id": "ab" * 16, "value": 1}, "trace_id", "got response_id and trace_id"),
        ({"response_id": "x"}, "value", "value is missing"),
        ({"response_id": "x", "value": "1"}, "value", "must be a number, not str"),
        ({"response_id": "x", "value": True}, "value", "must be a number, not bool"),
        ({"response_id": "x", "value": 10**400}, "value", "finite"),
        ({"response_id": 7, "value": 1}, "response_id", "must be a string"),
        ({"response_id": "x", "value": 1, "name": "a b"}, "name", "pattern"),
        ({"response_id": "x", "value": 1, "comment": 3}, "comment", "must be a string"),
        ({"trace_id": "XY" * 16, "value": 1}, "trace_id", "trace_id: a trace id is 32 lowercase hex"),
        ({"response_id": "x", "value": 1, "reward": 1}, "reward", "unknown field"),
    ],
)
def test_a_bad_request_says_which_field_and_why(request_: object, param: str | None, words: str) -> None:
    with pytest.raises(FeedbackRequestError, match=words) as raised:
        feedback_from(request_, source="api")
    assert raised.value.param == param
    assert "{'target'" not in raised.value.message  # the contract's input is not echoed back


# --- the worker's policy ----------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


class PausingConsumer(FakeConsumer):
    def paused(self) -> set[TopicPartition]:
        return set()

    def pause(self, *partitions: TopicPartition) -> None:
        raise AssertionError("nothing here should pause")


class FakeResolver:
    """Knows the targets in ``known``; counts the lookups."""

    def __init__(self) -> None:
        self.known: dict[tuple[str, str], list[Resolved]] = {}
        self.lookups: list[set] = []

    def resolve(self, targets):
        targets = set(targets)
        self.lookups.append(targets)
        return {target: self.known[target] for target in targets if target in self.known}


class Rig:
    def __init__(self, grace_s: float = 5.0) -> None:
        self.consumer = PausingConsumer()
        self.store = FakeStore(self.consumer.events)
        self.producer = FakeProducer(self.consumer.events)
        self.resolver, self.barrier, self.clock = FakeResolver(), FakeBarrier(), Clock()
        section = FeedbackSection(resolve_grace_s=grace_s, retry_first_s=0.5, retry_max_s=2.0)
        self.worker = FeedbackWorker(
            FeedbackSink(section),
            self.consumer,
            self.store,
            DeadLetters(self.producer),
            self.barrier,
            section,  # type: ignore[arg-type]
            resolver=self.resolver,
            clock=self.clock,
        )

    def send(self, feedback: Feedback | bytes) -> None:
        value = feedback if isinstance(feedback, bytes) else encode(feedback)
        self.consumer.append(TOPIC, 0, value, b"key")

    async def poll(self, after_s: float = 0.0) -> None:
        self.clock.now += after_s
        await self.worker.poll_once(asyncio.Event())

    def rows(self) -> list[dict]:
        return self.store.rows("feedback")


def sent_at(seconds_ago: float = 0.0, **fields: object) -> Feedback:
    when = datetime.fromtimestamp(NOW - seconds_ago, UTC)
    return Feedback(**{"target": "response", "target_id": "chatcmpl-1", "value": 1.0, "timestamp": when} | fields)


CALL = Resolved("r1", 2, "ab" * 16, "cd" * 8)


async def test_a_found_target_is_stored_then_committed_and_poison_is_dead_lettered_alone() -> None:
    rig = Rig()
    rig.resolver.known[("response", "chatcmpl-1")] = [CALL]
    rig.resolver.known[("rollout", "r1")] = [Resolved("r1", 2, "", "")]
    rig.send(sent_at(value=0.5))
    rig.send(b'{"target": "response"')
    rig.send(sent_at(target="rollout", target_id="r1", name="thumbs", comment="nice"))
    await rig.poll()
    assert len(rig.resolver.lookups) == 1  # one query for the round, not one per record
    rows = rig.rows()
    assert [(r["Target"], r["RolloutId"], r["Attempt"], r["SpanId"], r["Name"], r["Value"]) for r in rows] == [
        ("response", "r1", 2, "cd" * 8, "reward", 0.5),
        ("rollout", "r1", 2, "", "thumbs", 1.0),
    ]
    assert rows[1]["Comment"] == "nice" and rows[0]["TraceId"] == "ab" * 16
    assert rig.consumer.committed == {TP: 3}
    assert rig.consumer.events == ["dlq-send", "insert", "commit"]  # committed after the insert and the dead letter
    assert DeadLetterHeaders.from_kafka(rig.producer.sent[0]["headers"]).error_type == "DecodeError"


async def test_a_target_found_later_is_looked_up_again_with_backoff_and_holds_back_the_commit() -> None:
    rig = Rig(grace_s=30)
    rig.resolver.known[("response", "other")] = [CALL]
    rig.send(sent_at())
    rig.send(sent_at(target_id="other"))
    await rig.poll()
    assert [r["TargetId"] for r in rig.rows()] == ["other"]  # the one behind it is not held up
    assert rig.consumer.committed == {}  # ... but its offset is not committed past the one that waits
    waits = []
    for _ in range(4):
        before = len(rig.resolver.lookups)
        step = 0.0
        while len(rig.resolver.lookups) == before:
            step += 0.25
            await rig.poll(0.25)
        waits.append(step)
    assert waits == [0.5, 1.0, 2.0, 2.0]  # doubling from retry_first_s, at most retry_max_s
    rig.resolver.known[("response", "chatcmpl-1")] = [CALL, Resolved("r1", 2, "ab" * 16, "ef" * 8)]  # n=2 choices
    await rig.poll(2.0)
    assert [r["SpanId"] for r in rig.rows()] == ["cd" * 8, "cd" * 8, "ef" * 8]
    assert rig.consumer.committed == {TP: 2} and rig.producer.sent == []


async def test_an_unknown_target_is_dead_lettered_after_the_grace_once_the_spans_are_stored() -> None:
    rig = Rig(grace_s=5)
    rig.barrier.end, rig.barrier.commit = 10, 7  # the spans consumer is behind
    rig.send(sent_at())
    await rig.poll()
    for _ in range(40):  # 10 s: past the grace, still waiting for the spans consumer
        await rig.poll(0.25)
    assert rig.producer.sent == [] and rig.consumer.committed == {}
    lookups = len(rig.resolver.lookups)
    rig.barrier.commit = 10  # it caught up: everything published before the grace ended is stored
    await rig.poll(0.5)
    assert len(rig.resolver.lookups) == lookups + 1  # looked up once more, then dead-lettered
    [sent] = rig.producer.sent
    headers = DeadLetterHeaders.from_kafka(sent["headers"])
    assert headers.error_type == "UnknownTargetError"
    assert "no LLM call with response id chatcmpl-1 in the store" in headers.error
    assert (sent["key"], headers.source_topic, headers.source_offset) == (b"key", TOPIC, 0)
    assert rig.consumer.committed == {TP: 1} and rig.rows() == []
    assert rig.consumer.events[-2:] == ["dlq-send", "commit"]


async def test_the_deadline_counts_from_the_timestamp_but_never_from_the_future() -> None:
    rig = Rig(grace_s=5)
    rig.send(sent_at(seconds_ago=60, target="trace", target_id="ab" * 16))  # sent long ago: no waiting
    rig.send(sent_at(seconds_ago=-3600, target="rollout", target_id="r9"))  # a clock an hour ahead
    await rig.poll()
    await rig.poll(0.5)
    [old] = rig.producer.sent
    assert "no span of trace " + "ab" * 16 in DeadLetterHeaders.from_kafka(old["headers"]).error
    while len(rig.producer.sent) < 2:
        await rig.poll(0.25)
    assert NOW + 5 <= rig.clock.now <= NOW + 6  # 5 s after it was read, not an hour
    assert "no rollout r9 in the store" in DeadLetterHeaders.from_kafka(rig.producer.sent[1]["headers"]).error
    assert rig.consumer.committed == {TP: 2}


async def test_a_revoked_partition_forgets_what_waits_on_it() -> None:
    rig = Rig()
    rig.send(sent_at())
    await rig.poll()
    assert len(rig.worker.waiting) == 1
    await rig.worker.revoked([TP])
    assert rig.worker.waiting == {} and rig.consumer.committed == {}
    await rig.poll(60)  # nothing of it is looked up or dead-lettered any more: its next owner reads it again
    assert rig.producer.sent == []


def test_resolve_grace_is_a_setting() -> None:
    assert FeedbackSection().resolve_grace_s == 30.0
    with pytest.raises(ValueError, match="RETRY_MAX_S"):
        FeedbackSection(retry_first_s=3, retry_max_s=1)
    assert timedelta(seconds=FeedbackSection(resolve_grace_s=0).resolve_grace_s) == timedelta(0)
