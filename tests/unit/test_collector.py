"""The collector against an in-memory consumer: group completion, latest attempt, timeouts, staleness, offsets."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from aiokafka.structs import TopicPartition

from fulmen.algorithm.service.collector import Collector
from fulmen.algorithm.service.dispatcher import DispatchedGroup
from fulmen.algorithm.service.groups import GroupBook, drop_stale
from fulmen.algorithm.service.samples import build_samples
from fulmen.algorithm.settings import AdvantageScope, IncompletePolicy
from fulmen.schemas.codec import encode
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import RolloutMode, RolloutStatus, Transition, TransitionBatch
from tests.fakes import FakeConsumer

TOPIC = "fulmen.transitions"
TP0 = TopicPartition(TOPIC, 0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def spec(group: str = "g1", size: int = 3, max_attempts: int = 2, mode: RolloutMode = RolloutMode.TRAIN):
    rollouts = tuple(f"{group}-r{i}" for i in range(size))
    return DispatchedGroup(group, f"task-{group}", mode, size, max_attempts, 0, rollouts)


def batch(
    group: str,
    rollout: int,
    reward: float | None = 1.0,
    *,
    attempt: int = 1,
    calls: int = 1,
    status: RolloutStatus = RolloutStatus.SUCCEEDED,
    version: int | None = 0,
    call_versions: list[int | None] | None = None,
) -> TransitionBatch:
    rollout_id = f"{group}-r{rollout}"
    versions = call_versions or [version] * calls
    transitions = [
        Transition(
            rollout_id=rollout_id,
            attempt=attempt,
            index=i,
            trace_id="a" * 32,
            span_id=f"{i:016x}",
            model_version=v,
            prompt_token_ids=[1, 2, 3],
            response_token_ids=[4, 5 + i],
            response_logprobs=[-0.5, -0.7],
            reward=reward,
        )
        for i, v in enumerate(versions)
    ]
    return TransitionBatch(
        rollout_id=rollout_id,
        attempt=attempt,
        task_id=f"task-{group}",
        group_id=group,
        status=status,
        episode_reward=reward if status is RolloutStatus.SUCCEEDED else None,
        model_version=version,
        transitions=transitions,
    )


def collector(policy: str = IncompletePolicy.TRAIN_PARTIAL, timeout_s: float = 60.0, min_group_size: int = 2):
    source, clock = FakeConsumer(), Clock()
    book = GroupBook(timeout_s=timeout_s, policy=policy, min_group_size=min_group_size, clock=clock)
    return Collector(source, book, poll_timeout_ms=0), source, clock


def send(source: FakeConsumer, *batches: TransitionBatch, partition: int = 0) -> None:
    for item in batches:
        source.append(TOPIC, partition, encode(item), item.group_id.encode())


def poll(c: Collector):
    return asyncio.run(c.poll())


def test_a_group_completes_with_all_its_rollouts_and_commits_only_when_done() -> None:
    c, source, _ = collector()
    c.expect([spec("g1", size=3)])
    send(source, batch("g1", 0), batch("g1", 1))
    assert poll(c) == []
    assert asyncio.run(c.commit()) == {}  # both records held by the open group
    send(source, batch("g1", 2, reward=0.0))
    [group] = poll(c)
    assert (group.group_id, group.partial, group.kept) == ("g1", False, True)
    assert [r.rollout_id for r in group.rollouts] == ["g1-r0", "g1-r1", "g1-r2"]
    assert asyncio.run(c.commit()) == {}  # closed but not yet trained on
    c.done(["g1"])
    assert asyncio.run(c.commit()) == {TP0: 3}
    assert source.committed == {TP0: 3}


def test_the_latest_attempt_of_a_rollout_wins_and_a_retryable_failure_keeps_the_group_open() -> None:
    c, source, _ = collector()
    c.expect([spec("g1", size=2, max_attempts=2)])
    failed = batch("g1", 1, None, status=RolloutStatus.FAILED)
    first = batch("g1", 0)
    send(source, first, failed)
    assert poll(c) == []  # r1 failed at attempt 1 of 2: its retry may still come
    redelivered = batch("g1", 0, reward=0.9, attempt=1).model_copy(update={"created_at": first.created_at})
    send(source, redelivered, batch("g1", 1, reward=0.25, attempt=2))
    [group] = poll(c)
    by_rollout = {r.rollout_id: r for r in group.rollouts}
    assert by_rollout["g1-r1"].attempt == 2 and by_rollout["g1-r1"].episode_reward == 0.25
    assert by_rollout["g1-r0"].episode_reward == 1.0  # same attempt redelivered: the first copy stays
    assert c.older_attempts == 1


def test_a_rebuilt_batch_of_the_same_attempt_replaces_the_first_build() -> None:
    c, source, _ = collector()
    c.expect([spec("g1", size=2, max_attempts=2)])
    first = batch("g1", 0, reward=0.5)
    rebuilt = batch("g1", 0, reward=0.5, calls=2).model_copy(
        update={"created_at": first.created_at + timedelta(seconds=5)}
    )  # a late span arrived: the transitions consumer built the rollout again
    send(source, first, rebuilt, batch("g1", 1))
    [group] = poll(c)
    assert len({r.rollout_id: r for r in group.rollouts}["g1-r0"].transitions) == 2


def test_a_failure_on_the_last_attempt_is_final() -> None:
    c, source, _ = collector()
    c.expect([spec("g1", size=2, max_attempts=2)])
    send(source, batch("g1", 0), batch("g1", 1, None, attempt=2, status=RolloutStatus.TIMED_OUT))
    [group] = poll(c)
    assert not group.partial


def test_an_older_attempt_after_a_newer_one_is_ignored() -> None:
    c, source, _ = collector()
    c.expect([spec("g1", size=2, max_attempts=3)])
    send(
        source,
        batch("g1", 1, 0.5, attempt=2, status=RolloutStatus.SUCCEEDED),
        batch("g1", 1, None, attempt=1, status=RolloutStatus.FAILED),
        batch("g1", 0),
    )
    [group] = poll(c)
    assert {r.rollout_id: r.attempt for r in group.rollouts} == {"g1-r0": 1, "g1-r1": 2}


@pytest.mark.parametrize(
    ("policy", "arrived", "kept"),
    [
        (IncompletePolicy.TRAIN_PARTIAL, 2, True),
        (IncompletePolicy.TRAIN_PARTIAL, 1, False),  # below min_group_size: no baseline to compare with
        (IncompletePolicy.DROP, 2, False),
    ],
)
def test_a_timed_out_group_is_kept_or_dropped_by_the_policy(policy: str, arrived: int, kept: bool) -> None:
    c, source, clock = collector(policy, timeout_s=30)
    c.expect([spec("g1", size=4)])
    send(source, *[batch("g1", i) for i in range(arrived)])
    assert poll(c) == []
    clock.now = 29.9
    assert poll(c) == []
    clock.now = 30.0
    [group] = poll(c)
    assert (group.partial, group.kept, len(group.rollouts)) == (True, kept, arrived)
    # a dropped group's records are done at once; a kept one waits for the step
    assert asyncio.run(c.commit()) == ({} if kept else {TP0: arrived})


def test_a_group_with_nothing_arrived_times_out_too() -> None:
    c, _, clock = collector(IncompletePolicy.TRAIN_PARTIAL, timeout_s=5)
    c.expect([spec("g1")])
    clock.now = 5
    [group] = poll(c)
    assert (group.kept, group.rollouts) == (False, ())


def test_an_unknown_policy_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigurationError, match="train_partial, drop"):
        GroupBook(timeout_s=1, policy="wait_forever")


def test_unknown_groups_and_undecodable_records_are_skipped_and_committable() -> None:
    c, source, _ = collector()
    c.expect([spec("g1", size=2)])
    send(source, batch("other", 0))
    source.append(TOPIC, 0, b"{not json")
    send(source, batch("g1", 0))
    assert poll(c) == []
    assert (c.ignored, c.undecodable) == (1, 1)
    assert asyncio.run(c.commit()) == {TP0: 2}  # up to the held record of g1
    send(source, batch("g1", 1))
    [group] = poll(c)
    c.done([group.group_id])
    assert asyncio.run(c.commit()) == {TP0: 4}


def test_offsets_are_per_partition() -> None:
    c, source, _ = collector()
    c.expect([spec("g1", size=1), spec("g2", size=1)])
    send(source, batch("g1", 0), partition=0)
    send(source, batch("g2", 0), partition=1)
    assert {g.group_id for g in poll(c)} == {"g1", "g2"}
    c.done(["g2"])
    assert asyncio.run(c.commit()) == {TopicPartition(TOPIC, 1): 1}


def test_stale_transitions_are_dropped_and_counted() -> None:
    c, source, _ = collector()
    c.expect([spec("g1", size=2)])
    send(source, batch("g1", 0, version=3), batch("g1", 1, version=None, call_versions=[1, 2, None]))
    [group] = poll(c)
    fresh, dropped = drop_stale(group, current_version=4, max_staleness=1)  # oldest allowed: 3
    assert dropped == 2
    assert [len(r.transitions) for r in fresh.rollouts] == [1, 1]  # unknown version (None) kept
    assert fresh.rollouts[1].transitions[0].index == 2  # keeps its call position
    _, also_batch = drop_stale(group, current_version=5, max_staleness=1)  # a call without one: its batch's
    assert also_batch == 3
    same, none = drop_stale(group, current_version=4, max_staleness=3)
    assert (none, same.num_transitions) == (0, 4)


def test_episode_advantages_are_broadcast_to_every_call_of_a_rollout() -> None:
    c, source, _ = collector()
    c.expect([spec("g1", size=2), spec("g2", size=2)])
    send(source, batch("g1", 0, 1.0, calls=2), batch("g1", 1, 0.0), batch("g2", 0, 0.5), batch("g2", 1, 0.5))
    groups = poll(c)
    data = build_samples(groups, estimator="dr_grpo", scope=AdvantageScope.EPISODE)
    assert [(s.group_id, s.advantage) for s in data.samples] == [
        ("g1", 0.5),
        ("g1", 0.5),
        ("g1", -0.5),
        ("g2", 0.0),
        ("g2", 0.0),
    ]
    assert data.returns == [1.0, 0.0, 0.5, 0.5]
    assert data.samples[0].old_logprobs == [-0.5, -0.7]
    per_call = build_samples(groups, estimator="dr_grpo", scope=AdvantageScope.TRANSITION)
    assert [round(s.advantage, 4) for s in per_call.samples] == [0.3333, 0.3333, -0.6667, 0.0, 0.0]
