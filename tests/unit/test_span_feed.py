"""The span feed's bookkeeping: coverage and epochs, taking and dropping, the memory bound, late arrivals."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka.structs import TopicPartition

from fulmen.consumers.transitions.feed import SpanFeed

SPANS = [TopicPartition("spans", p) for p in range(2)]


def record(rollout: str, span: str, attempt: int = 1, tokens: int = 0) -> tuple[Any, ...]:
    ids = b"\x01\x00\x00\x00" * tokens
    head = (rollout, attempt, "t" * 32, span, "", "call", 10, 5, "solver", None)
    return (*head, ids, ids, b"", None, ["", "", ""], [], [[], [], []], [], [])


def covering_feed(**kwargs: Any) -> SpanFeed:
    feed = SpanFeed(**kwargs)
    feed.expect(SPANS)
    feed.assigned(SPANS)
    return feed


def test_it_holds_nothing_until_the_spans_consumer_owns_every_partition() -> None:
    feed = SpanFeed()
    feed.assigned(SPANS[:1])
    feed.add([record("r1", "a")])
    assert not feed.covering and len(feed) == 0  # the spans topic's partitions are not known yet
    feed.expect(SPANS)
    assert not feed.covering
    feed.assigned(SPANS[1:])
    assert feed.covering
    feed.add([record("r1", "a")])
    assert len(feed) == 1


def test_every_change_of_assignment_starts_a_new_epoch_and_drops_what_is_held() -> None:
    feed = covering_feed()
    feed.add([record("r1", "a")])
    epoch = feed.epoch
    feed.revoked(SPANS)
    feed.assigned(SPANS)
    assert feed.epoch == epoch + 2 and len(feed) == 0 and feed.held_bytes == 0
    feed.expect(SPANS)
    assert feed.epoch == epoch + 2  # the same partitions: no new epoch
    feed.expect([*SPANS, TopicPartition("spans", 2)])
    assert feed.epoch == epoch + 3 and not feed.covering


def test_take_releases_the_spans_of_one_attempt_once_each() -> None:
    feed = covering_feed()
    feed.add([record("r1", "a"), record("r1", "b"), record("r1", "a"), record("r1", "c", attempt=2)])
    spans = feed.take(("r1", 1))
    assert spans is not None and sorted(s.span_id for s in spans) == ["a", "b"]  # a redelivered span once
    assert feed.take(("r1", 1)) == []
    assert [s.span_id for s in feed.take(("r1", 2)) or []] == ["c"]
    assert feed.held_bytes == 0


def test_a_rollout_dropped_for_room_is_never_vouched_for() -> None:
    feed = covering_feed(max_bytes=4000)
    feed.add([record("old", "a", tokens=200)])
    feed.add([record("new", "a", tokens=200)])  # over 4000 bytes: "old" goes
    assert feed.evictions == 1 and feed.held_bytes <= 4000
    feed.add([record("old", "b")])  # more of it arrives: still incomplete
    assert feed.take(("old", 1)) is None
    assert [s.span_id for s in feed.take(("new", 1)) or []] == ["a"]


def test_too_many_dropped_rollouts_start_a_new_epoch() -> None:
    feed = covering_feed(max_bytes=1500, max_evicted=2)
    epoch = feed.epoch
    for i in range(4):
        feed.add([record(f"r{i}", "a", tokens=20)])
    assert feed.epoch > epoch


def test_a_span_after_the_take_shows_as_arrived() -> None:
    feed = covering_feed()
    feed.want("r1")
    feed.add([record("r1", "a")])
    feed.take(("r1", 1))
    assert not feed.arrived(("r1", 1)) and "r1" not in feed.wanted  # not wanted once built
    feed.add([], skipped=[("r1", 1)])  # its late span, flattened as not wanted
    assert feed.arrived(("r1", 1))
    feed.discard(("r1", 1))
    assert not feed.arrived(("r1", 1))


def test_a_rollout_with_spans_flattened_before_its_claim_was_seen_is_not_vouched_for() -> None:
    feed = covering_feed()
    feed.add([], skipped=[("r1", 1)])  # a span of r1 before the worker read r1's claim
    feed.want("r1")
    feed.add([record("r1", "b")])
    assert feed.take(("r1", 1)) is None


def test_too_many_wanted_rollouts_start_a_new_epoch() -> None:
    feed = covering_feed(max_evicted=2)
    epoch = feed.epoch
    for i in range(3):
        feed.want(f"r{i}")
    assert feed.epoch > epoch and feed.wanted == set()


def test_token_ids_and_logprobs_come_back_as_numbers() -> None:
    feed = covering_feed()
    row = list(record("r1", "a"))
    row[10], row[11] = bytes([5, 0, 0, 0, 6, 0, 0, 0]), bytes([7, 0, 0, 0])
    row[12] = b"\x00\x00\x00\xbf"  # -0.5 as a little-endian float32
    feed.add([tuple(row)])
    (span,) = feed.take(("r1", 1)) or []
    assert (span.prompt_token_ids, span.response_token_ids, span.response_logprobs) == ((5, 6), (7,), (-0.5,))


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        SpanFeed(max_bytes=0)
