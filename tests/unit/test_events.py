"""Every contract round-trips through its Kafka encoding; invalid input is refused naming the field."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulmen.schemas import (
    DeadLetterHeaders,
    DecodeError,
    ModelVersion,
    RolloutEvent,
    RolloutMode,
    RolloutRequest,
    RolloutStatus,
    TrainStep,
    Transition,
    TransitionBatch,
    decode,
    decode_obj,
    encode,
)
from fulmen.schemas.events import production_rollout_id, production_trace_id

ids = st.from_regex(r"[A-Za-z0-9._:\-]{1,40}", fullmatch=True)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
times = st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | finite | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


@st.composite
def rollout_requests(draw: st.DrawFn) -> RolloutRequest:
    max_attempts = draw(st.integers(1, 10))
    return RolloutRequest(
        rollout_id=draw(ids),
        task_id=draw(ids),
        group_id=draw(ids),
        attempt=draw(st.integers(1, max_attempts)),
        max_attempts=max_attempts,
        timeout_s=draw(st.floats(0.1, 1e5)),
        mode=draw(st.sampled_from(["train", "val"])),
        input=draw(st.dictionaries(st.text(max_size=10), json_values, max_size=5)),
        model_version=draw(st.none() | st.integers(0, 10**6)),
        metadata=draw(st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)),
        created_at=draw(times),
    )


@st.composite
def rollout_events(draw: st.DrawFn) -> RolloutEvent:
    status = draw(st.sampled_from(list(RolloutStatus)))
    return RolloutEvent(
        rollout_id=draw(ids),
        attempt=draw(st.integers(1, 100)),
        status=status,
        task_id=draw(ids),
        group_id=draw(ids),
        reward=draw(st.none() | finite) if status is RolloutStatus.SUCCEEDED else None,
        error=draw(st.text(min_size=1, max_size=50))
        if status in (RolloutStatus.FAILED, RolloutStatus.TIMED_OUT)
        else None,
        runner_id=draw(st.text(max_size=10)),
        model_version=draw(st.none() | st.integers(0, 1000)),
        timestamp=draw(times),
    )


@st.composite
def transition_batches(draw: st.DrawFn) -> TransitionBatch:
    rollout_id, attempt = draw(ids), draw(st.integers(1, 5))
    calls = []
    for index in range(draw(st.integers(0, 4))):
        response = draw(st.lists(st.integers(0, 200_000), min_size=1, max_size=20))
        calls.append(
            Transition(
                rollout_id=rollout_id,
                attempt=attempt,
                index=index,
                trace_id=draw(st.from_regex(r"[0-9a-f]{32}", fullmatch=True)),
                span_id=draw(st.from_regex(r"[0-9a-f]{16}", fullmatch=True)),
                agent_name=draw(st.text(max_size=10)),
                model_version=draw(st.none() | st.integers(0, 100)),
                prompt_token_ids=draw(st.lists(st.integers(0, 200_000), min_size=1, max_size=30)),
                response_token_ids=response,
                response_logprobs=draw(
                    st.none() | st.lists(st.floats(-50, 0), min_size=len(response), max_size=len(response))
                ),
                reward=draw(st.none() | finite),
                intermediate_reward=draw(st.none() | finite),
            )
        )
    return TransitionBatch(
        rollout_id=rollout_id,
        attempt=attempt,
        task_id=draw(ids),
        group_id=draw(ids),
        status=draw(st.sampled_from([RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.TIMED_OUT])),
        episode_reward=draw(st.none() | finite),
        transitions=calls,
        created_at=draw(times),
    )


model_versions = st.builds(
    ModelVersion,
    model_name=ids,
    version=st.integers(0, 10**9),
    uri=st.text(min_size=1, max_size=30),
    format=st.sampled_from(["hf", "hf_lora_adapter"]),
    step=st.integers(0, 10**6),
    created_at=times,
)
train_steps = st.builds(
    TrainStep,
    run_id=ids,
    step=st.integers(0, 10**6),
    model_version=st.integers(0, 10**6),
    num_transitions=st.integers(0, 10**6),
    num_groups=st.integers(0, 10**4),
    reward_mean=finite,
    reward_std=st.floats(0, 1e6),
    loss=finite,
    clip_fraction=st.floats(0, 1),
    kl=st.none() | finite,
    extra=st.dictionaries(st.text(max_size=8), finite, max_size=3),
    created_at=times,
)


@pytest.mark.parametrize(
    "strategy",
    [rollout_requests(), rollout_events(), transition_batches(), model_versions, train_steps],
    ids=["RolloutRequest", "RolloutEvent", "TransitionBatch", "ModelVersion", "TrainStep"],
)
def test_every_contract_round_trips(strategy: st.SearchStrategy) -> None:
    @settings(max_examples=60, deadline=None)
    @given(strategy)
    def check(event) -> None:
        assert decode(type(event), encode(event)) == event

    check()


@given(
    st.builds(
        DeadLetterHeaders,
        source_topic=ids,
        source_partition=st.integers(0, 1000),
        source_offset=st.integers(0, 2**62),
        error_type=ids,
        error=st.text(min_size=0, max_size=100),
        consumer_group=st.text(max_size=10),
        failed_at=times,
    )
)
def test_dead_letter_headers_round_trip(headers: DeadLetterHeaders) -> None:
    kafka_headers = headers.to_kafka()
    assert all(isinstance(v, bytes) for _, v in kafka_headers)
    assert DeadLetterHeaders.from_kafka([*kafka_headers, ("traceparent", b"00-x")]) == headers


def _valid_event() -> dict:
    return {"rollout_id": "r1", "attempt": 1, "status": "succeeded", "task_id": "t1", "group_id": "g1", "reward": 0.5}


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"attempt": 0}, "attempt", "greater than or equal to 1"),
        ({"attempt": "two"}, "attempt", "valid integer"),
        ({"status": "done"}, "status", "'queued'"),
        ({"rollout_id": "has space"}, "rollout_id", "pattern"),
        ({"rollout_id": ""}, "rollout_id", "at least 1"),
        ({"reward": "high"}, "reward", "valid number"),
        ({"surprise": 1}, "surprise", "Extra inputs"),
        ({"status": "running"}, None, "only a succeeded rollout has a reward"),
        ({"status": "failed", "reward": None}, None, "must say why"),
    ],
)
def test_invalid_rollout_event_names_the_field(change: dict, field: str | None, words: str) -> None:
    with pytest.raises(DecodeError) as caught:
        decode_obj(RolloutEvent, {**_valid_event(), **change}, topic="fulmen.rollouts", partition=2, offset=41)
    error = caught.value
    assert words in str(error)
    if field:
        assert error.field == field
        assert f"RolloutEvent.{field}:" in str(error)
    assert "topic=fulmen.rollouts partition=2 offset=41" in str(error)


def test_missing_field_is_named() -> None:
    payload = _valid_event()
    del payload["task_id"]
    with pytest.raises(DecodeError, match=r"RolloutEvent\.task_id: Field required"):
        decode_obj(RolloutEvent, payload)


def test_newer_schema_version_says_so() -> None:
    with pytest.raises(DecodeError, match="knows version 1, the record has 2") as caught:
        decode(
            RolloutEvent, encode(RolloutEvent(**_valid_event())).replace(b'"schema_version":1', b'"schema_version":2')
        )
    assert caught.value.field == "schema_version"


@pytest.mark.parametrize("data", [b"", b"{", b"\xff\xfe", b"[]", b"null", None])
def test_garbage_bytes_are_a_decode_error(data: bytes | None) -> None:
    with pytest.raises(DecodeError):
        decode(RolloutRequest, data)


def test_request_attempt_cannot_exceed_budget() -> None:
    with pytest.raises(DecodeError, match="exceeds max_attempts"):
        decode_obj(RolloutRequest, {"task_id": "t", "group_id": "g", "input": {}, "attempt": 4, "max_attempts": 3})


def test_transition_logprobs_must_match_response() -> None:
    with pytest.raises(DecodeError, match="2 logprobs for 3 response tokens"):
        decode_obj(
            Transition,
            {
                "rollout_id": "r",
                "attempt": 1,
                "index": 0,
                "trace_id": "a" * 32,
                "span_id": "b" * 16,
                "prompt_token_ids": [1],
                "response_token_ids": [1, 2, 3],
                "response_logprobs": [-1.0, -2.0],
            },
        )


def test_transition_batch_checks_order_and_ownership() -> None:
    call = {
        "rollout_id": "r",
        "attempt": 1,
        "index": 1,
        "trace_id": "a" * 32,
        "span_id": "b" * 16,
        "prompt_token_ids": [1],
        "response_token_ids": [2],
    }
    batch = {"rollout_id": "r", "attempt": 1, "task_id": "t", "group_id": "g", "status": "succeeded"}
    with pytest.raises(DecodeError, match=r"transitions\.0\.index: is 1, expected 0"):
        decode_obj(TransitionBatch, {**batch, "transitions": [call]})
    with pytest.raises(DecodeError, match="belongs to rollout other"):
        decode_obj(TransitionBatch, {**batch, "transitions": [{**call, "index": 0, "rollout_id": "other"}]})
    with pytest.raises(DecodeError, match="finished rollout, not running"):
        decode_obj(TransitionBatch, {**batch, "status": "running"})


def test_times_are_utc() -> None:
    naive = RolloutRequest(task_id="t", group_id="g", input={}, created_at=datetime(2026, 1, 1, 12))
    assert naive.created_at.tzinfo is UTC
    shifted = RolloutRequest(
        task_id="t", group_id="g", input={}, created_at=datetime(2026, 1, 1, 12, tzinfo=timezone(timedelta(hours=2)))
    )
    assert shifted.created_at == datetime(2026, 1, 1, 10, tzinfo=UTC)
    assert shifted.created_at.utcoffset() == timedelta(0)


def test_status_ranks_follow_the_lifecycle() -> None:
    order = [RolloutStatus.QUEUED, RolloutStatus.CLAIMED, RolloutStatus.RUNNING, RolloutStatus.SUCCEEDED]
    assert [s.rank for s in order] == sorted(s.rank for s in order)
    assert {s for s in RolloutStatus if s.terminal} == {
        RolloutStatus.SUCCEEDED,
        RolloutStatus.FAILED,
        RolloutStatus.TIMED_OUT,
    }


def test_only_a_production_rollout_has_no_group() -> None:
    production = {**_valid_event(), "rollout_id": "trace-" + "ab" * 16, "group_id": "", "mode": "production"}
    event = decode(RolloutEvent, encode(decode_obj(RolloutEvent, production)))
    assert (event.group_id, event.mode) == ("", RolloutMode.PRODUCTION)
    with pytest.raises(DecodeError, match="a train rollout belongs to a group; only a production rollout has none"):
        decode_obj(RolloutEvent, {**_valid_event(), "group_id": ""})
    batch = {"rollout_id": "r", "attempt": 1, "task_id": "t", "group_id": "", "status": "succeeded"}
    assert decode_obj(TransitionBatch, {**batch, "mode": "production"}).group_id == ""
    with pytest.raises(DecodeError, match="a val rollout belongs to a group"):
        decode_obj(TransitionBatch, {**batch, "mode": "val"})


def test_production_rollouts_are_recorded_never_requested() -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    assert production_rollout_id(trace_id) == f"trace-{trace_id}"
    assert production_trace_id(production_rollout_id(trace_id)) == trace_id
    for other in ("trace-4BF92F3577B34DA6A3CE929D0E0E4736", f"trace-{trace_id}0", "r-1", trace_id):
        assert production_trace_id(other) is None
    assert [m for m in RolloutMode if m.dispatched] == [RolloutMode.TRAIN, RolloutMode.VAL]
    request = {"task_id": "t", "group_id": "g", "input": {}}
    with pytest.raises(DecodeError, match="production rollouts are recorded from agents Fulmen does not run"):
        decode_obj(RolloutRequest, {**request, "mode": "production"})
    with pytest.raises(DecodeError, match="is a production episode's id"):
        decode_obj(RolloutRequest, {**request, "rollout_id": f"trace-{trace_id}"})
