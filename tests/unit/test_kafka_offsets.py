"""The shared offset layer against fakes: lowest unfinished offset, commits refused by a rebalance, the listener,
the retry backoff (no broker: the real one is exercised by the integration tests of the loops that use it)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from aiokafka.errors import (
    CommitFailedError,
    IllegalGenerationError,
    IllegalStateError,
    KafkaConnectionError,
    RebalanceInProgressError,
    UnknownMemberIdError,
)
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from fulmen.infra.kafka.offsets import OffsetTracker, RebalanceListener, commit_finished, commit_offsets
from fulmen.infra.retry import STOPPED, backoff_s, retrying
from fulmen.schemas.errors import RetryableError

TP0, TP1, TP2 = (TopicPartition("fulmen.tasks", p) for p in range(3))


class Consumer:
    """The two calls the commit helpers make; ``refuse`` is raised by the next commit (once)."""

    def __init__(self, *assigned: TopicPartition) -> None:
        self.assigned = set(assigned)
        self.committed: dict[TopicPartition, int] = {}
        self.calls: list[dict[TopicPartition, int]] = []
        self.refuse: Exception | None = None

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    async def commit(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        self.calls.append({tp: meta.offset for tp, meta in offsets.items()})
        if self.refuse is not None:
            error, self.refuse = self.refuse, None
            raise error
        for tp, meta in offsets.items():
            self.committed[tp] = meta.offset


def tracker_with(tp: TopicPartition, offsets: range) -> OffsetTracker:
    tracker = OffsetTracker()
    for offset in offsets:
        tracker.read(tp, offset)
    return tracker


# --- lowest unfinished offset ----------------------------------------------------------------------------------
def test_out_of_order_completion_commits_only_the_finished_prefix() -> None:
    tracker = tracker_with(TP0, range(10, 14))
    tracker.done(TP0, 12)
    assert tracker.committable() == {}  # 10 and 11 still running
    tracker.done(TP0, 10)
    assert tracker.committable() == {TP0: 11}
    tracker.done(TP0, 11)
    assert tracker.committable() == {TP0: 13}  # 12 was already done
    assert (tracker.unfinished(), tracker.pending(TP0)) == (1, 1)
    tracker.committed({TP0: 13})
    assert tracker.committable() == {}
    tracker.done(TP0, 13)
    assert tracker.committable() == {TP0: 14} and tracker.pending() == 0


def test_a_finished_offset_is_offered_until_a_commit_of_it_went_out() -> None:
    tracker = tracker_with(TP0, range(3))
    tracker.done(TP0, 0)
    assert tracker.committable() == tracker.committable() == {TP0: 1}
    tracker.committed({TP0: 1})
    assert tracker.committable() == {}


def test_partitions_are_independent_and_can_be_asked_for_alone() -> None:
    tracker = tracker_with(TP0, range(2))
    tracker.read(TP1, 40)
    tracker.done(TP0, 0)
    tracker.done(TP1, 40)
    assert tracker.committable(partitions=[TP1]) == {TP1: 41}
    assert tracker.committable() == {TP0: 1, TP1: 41}


def test_ready_at_holds_a_finished_offset_back_until_now_passes_it() -> None:
    tracker = tracker_with(TP0, range(3))
    tracker.done(TP0, 0, ready_at=1.0)
    tracker.done(TP0, 1, ready_at=10.0)  # e.g. a late window
    tracker.done(TP0, 2, ready_at=1.0)
    assert tracker.committable(now=5.0) == {TP0: 1}
    tracker.done(TP0, 1, ready_at=20.0)  # the window moved
    assert tracker.committable(now=15.0) == {TP0: 1}
    assert tracker.committable(now=20.0) == {TP0: 3}


def test_reads_twice_out_of_order_and_of_unknown_offsets_are_handled() -> None:
    tracker = tracker_with(TP0, [5, 7])
    tracker.read(TP0, 6)  # a seek back: kept in offset order
    tracker.read(TP0, 7)  # read again: still one entry, still unfinished
    assert tracker.done(TP0, 99) is False and tracker.done(TP2, 0) is False  # never read: ignored
    tracker.done(TP0, 5)
    tracker.done(TP0, 7)
    assert tracker.committable() == {TP0: 6}  # 6 is not done
    tracker.read(TP0, 5)  # already passed: not tracked again
    tracker.done(TP0, 6)
    assert tracker.committable() == {TP0: 8} and tracker.pending() == 0


def test_a_revoked_partition_is_forgotten_and_its_late_completions_ignored() -> None:
    tracker = tracker_with(TP0, range(3))
    tracker.read(TP1, 0)
    tracker.done(TP0, 0)
    tracker.forget([TP0])
    assert tracker.done(TP0, 1) is False  # a rollout of the revoked partition ends after the revoke
    tracker.committed({TP0: 1})  # a commit that was in flight during the revoke: no KeyError
    assert tracker.partitions() == {TP1} and tracker.committable() == {}
    tracker.read(TP0, 1)  # assigned again: read afresh from the committed offset
    tracker.done(TP0, 1)
    assert tracker.committable() == {TP0: 2}


# --- committing ------------------------------------------------------------------------------------------------
async def test_commit_finished_commits_and_remembers_what_went_out() -> None:
    consumer, tracker = Consumer(TP0), tracker_with(TP0, range(4))
    for offset in (0, 1, 3):
        tracker.done(TP0, offset)
    assert await commit_finished(consumer, tracker, what="test") == {TP0: 2}
    assert consumer.committed == {TP0: 2}
    assert await commit_finished(consumer, tracker, what="test") == {}  # nothing new: no round trip
    assert len(consumer.calls) == 1


async def test_offsets_of_a_partition_no_longer_assigned_are_not_sent() -> None:
    consumer, tracker = Consumer(TP1), tracker_with(TP0, range(2))
    tracker.read(TP1, 7)
    tracker.done(TP0, 0)
    tracker.done(TP1, 7)
    assert await commit_finished(consumer, tracker, what="test") == {TP1: 8}
    assert consumer.calls == [{TP1: 8}]
    consumer.assigned = set()
    assert await commit_offsets(consumer, {TP0: 1}, what="test") == {} and len(consumer.calls) == 1


@pytest.mark.parametrize(
    "error",
    [
        CommitFailedError("rebalanced"),
        IllegalStateError("not assigned"),
        RebalanceInProgressError(),
        IllegalGenerationError(),
        UnknownMemberIdError(),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_a_commit_refused_by_a_rebalance_is_logged_and_offered_again(
    error: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    consumer, tracker = Consumer(TP0), tracker_with(TP0, range(2))
    tracker.done(TP0, 0)
    consumer.refuse = error
    with caplog.at_level(logging.WARNING):
        assert await commit_finished(consumer, tracker, what="the loop") == {}
    assert "the loop: commit of fulmen.tasks[0]=1 refused after a rebalance" in caplog.text
    assert consumer.committed == {}
    assert await commit_finished(consumer, tracker, what="the loop") == {TP0: 1}  # still owned: sent again


async def test_any_other_kafka_error_is_retryable_and_names_the_offsets() -> None:
    consumer, tracker = Consumer(TP0), tracker_with(TP0, range(1))
    tracker.done(TP0, 0)
    consumer.refuse = KafkaConnectionError("broker gone")
    with pytest.raises(RetryableError, match=r"the loop: committing fulmen.tasks\[0\]=1 failed"):
        await commit_finished(consumer, tracker, what="the loop")
    assert await commit_finished(consumer, tracker, what="the loop") == {TP0: 1}


async def test_a_partition_revoked_while_its_commit_is_in_flight() -> None:
    """The listener runs while the commit awaits the broker: the revoked partition is forgotten (no KeyError
    when the commit returns) and what finished meanwhile on a kept partition is still to commit."""
    tracker = tracker_with(TP0, range(3))
    for offset in range(3):
        tracker.read(TP1, offset)
    tracker.done(TP0, 0)
    tracker.done(TP1, 0)

    class Racing(Consumer):
        async def commit(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
            await super().commit(offsets)
            tracker.forget([TP0])
            self.assigned.discard(TP0)
            tracker.done(TP1, 1)

    consumer = Racing(TP0, TP1)
    assert await commit_finished(consumer, tracker, what="test") == {TP0: 1, TP1: 1}
    assert tracker.committable() == {TP1: 2} and tracker.partitions() == {TP1}


# --- the rebalance listener ------------------------------------------------------------------------------------
class Owner:
    """A loop owning its offsets: on revoke it commits the revoked partitions' finished offsets, then forgets."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.tracker = OffsetTracker()
        self.calls: list[tuple[str, list[TopicPartition]]] = []

    async def revoked(self, partitions: list[TopicPartition]) -> None:
        self.calls.append(("revoked", partitions))
        await commit_finished(self.consumer, self.tracker, what="owner", partitions=partitions)
        self.tracker.forget(partitions)

    def assigned(self, partitions: list[TopicPartition]) -> None:
        self.calls.append(("assigned", partitions))
        self.tracker.forget(partitions)


async def test_the_listener_commits_finished_work_of_revoked_partitions_mid_flight() -> None:
    consumer = Consumer(TP0, TP1)
    owner = Owner(consumer)
    for tp in (TP0, TP1):
        for offset in range(4):
            owner.tracker.read(tp, offset)
    owner.tracker.done(TP0, 0)
    owner.tracker.done(TP0, 2)  # 1 still running when TP0 is taken away
    owner.tracker.done(TP1, 0)
    listener = RebalanceListener(owner, "owner")
    await listener.on_partitions_revoked({TP0})
    assert consumer.committed == {TP0: 1}  # only the finished prefix of the revoked partition
    assert owner.tracker.partitions() == {TP1}
    assert owner.tracker.done(TP0, 1) is False  # it ends after the revoke: its new owner redoes it
    await listener.on_partitions_revoked(set())  # nothing revoked: the owner is not called
    await listener.on_partitions_assigned({TP2, TP0})
    assert owner.calls == [("revoked", [TP0]), ("assigned", [TP0, TP2])]


async def test_assignment_resets_what_was_known_of_the_partitions() -> None:
    owner = Owner(Consumer(TP0))
    owner.tracker.read(TP0, 3)
    owner.tracker.done(TP0, 3)
    await RebalanceListener(owner, "owner").on_partitions_assigned([TP0])
    assert owner.tracker.partitions() == set() and owner.tracker.committable() == {}


# --- retries ---------------------------------------------------------------------------------------------------
def test_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff_s(n, 0.5) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
    assert backoff_s(1000, 0.001) == pytest.approx(0.064)  # the doublings stop: never an overflow
    assert backoff_s(3, 1.0, longest_s=5.0) == 5.0


async def test_retrying_until_success_and_other_errors_propagate() -> None:
    failures = [RetryableError("store down"), OSError("refused")]

    async def flaky() -> str:
        if failures:
            raise failures.pop(0)
        return "ok"

    assert await retrying(flaky, what="insert", retry_on=(RetryableError, OSError), base_s=0.0001) == "ok"

    async def broken() -> Any:
        raise ValueError("a bug, not an outage")

    with pytest.raises(ValueError, match="a bug"):
        await retrying(broken, what="insert", retry_on=(RetryableError,), base_s=0.0001)


async def test_retrying_gives_up_when_stop_is_set_during_the_wait() -> None:
    stop, calls = asyncio.Event(), []

    async def down() -> None:
        calls.append(1)
        stop.set()  # set while the attempt runs: the wait is cut short, no further attempt
        raise RetryableError("broker down")

    assert (
        await asyncio.wait_for(retrying(down, what="publish", retry_on=(RetryableError,), base_s=60.0, stop=stop), 5)
        is STOPPED
    )
    assert calls == [1]
    assert await retrying(down, what="publish", retry_on=(RetryableError,), base_s=60.0, stop=stop) is STOPPED
    assert calls == [1]  # already stopped: not even tried
