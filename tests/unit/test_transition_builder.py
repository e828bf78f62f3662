"""Rollout → TransitionBatch (pure), and the worker's commit window and attempt tracking (no services)."""

from __future__ import annotations

import pytest
from aiokafka.structs import ConsumerRecord, TopicPartition

from fulmen.consumers.barrier import WaitingRounds, behind
from fulmen.consumers.settings import ConsumersSettings
from fulmen.consumers.transitions.builder import BuildOptions, build_batch
from fulmen.consumers.transitions.late import SLACK_MS, LateSpanCheck
from fulmen.consumers.transitions.window import AttemptTracker, BuildWindow, Built
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import RolloutEvent, RolloutStatus
from tests.unit.transition_spans import call, langgraph_rollout, rollout_root, sid, span


def ended(
    status: RolloutStatus = RolloutStatus.SUCCEEDED, reward: float | None = 1.0, **fields: object
) -> RolloutEvent:
    error = None if status is RolloutStatus.SUCCEEDED else "boom"
    return RolloutEvent(
        rollout_id="r1",
        attempt=fields.pop("attempt", 1),
        status=status,
        task_id="t1",
        group_id="g1",
        reward=reward if status is RolloutStatus.SUCCEEDED else None,
        error=error,
        model_version=3,
        **fields,
    )


def three_calls_with_a_reward() -> list:
    return [
        rollout_root(reward=1.0),
        span("agent", 5, 900, "rollout", agent="solver"),
        call("c1", 10, 100, "agent", logprobs=(-0.5,), version=7),
        span("r1", 110, 110, "agent", reward=0.2),
        call("c2", 200, 300, "agent", logprobs=(-0.1, -0.2)),  # 2 logprobs for 1 response token: dropped
        call("c3", 400, 500, "agent"),
    ]


def test_broadcast_batch_fields() -> None:
    result = build_batch(ended(reward=0.5), three_calls_with_a_reward(), BuildOptions())
    batch = result.batch
    assert (batch.rollout_id, batch.attempt, batch.group_id, batch.status) == ("r1", 1, "g1", RolloutStatus.SUCCEEDED)
    assert batch.episode_reward == 0.5 and batch.model_version == 3
    assert [t.index for t in batch.transitions] == [0, 1, 2]
    assert [t.span_id for t in batch.transitions] == [sid("c1"), sid("c2"), sid("c3")]
    assert [t.reward for t in batch.transitions] == [None, None, None]  # credited by the run that trains
    assert [t.intermediate_reward for t in batch.transitions] == [0.2, None, None]
    first = batch.transitions[0]
    assert (first.prompt_token_ids, first.response_token_ids, first.response_logprobs) == ([10, 11], [100], [-0.5])
    assert first.agent_name == "solver" and first.model_version == 7
    assert batch.transitions[1].response_logprobs is None and batch.transitions[1].model_version == 3
    assert (result.span_count, result.calls_made, result.unmatched_rewards, result.skipped) == (6, 3, 0, [])


def test_agent_pattern_selects_the_langgraph_nodes() -> None:
    result = build_batch(ended(), langgraph_rollout(), BuildOptions.create(agent_pattern="write|rewrite"))
    assert [(t.index, t.agent_name) for t in result.batch.transitions] == [(0, "write"), (1, "rewrite")]
    assert result.calls_made == 3 and result.grafted == 3


@pytest.mark.parametrize("status", [RolloutStatus.FAILED, RolloutStatus.TIMED_OUT])
def test_a_failed_rollout_keeps_its_calls_and_their_rewards(status: RolloutStatus) -> None:
    batch = build_batch(ended(status), three_calls_with_a_reward(), BuildOptions()).batch
    assert batch.status is status and batch.episode_reward is None
    assert [t.reward for t in batch.transitions] == [None, None, None]
    assert [t.intermediate_reward for t in batch.transitions] == [0.2, None, None]


def test_a_succeeded_rollout_without_reward_has_none() -> None:
    batch = build_batch(ended(reward=None), three_calls_with_a_reward(), BuildOptions()).batch
    assert batch.episode_reward is None and [t.reward for t in batch.transitions] == [None, None, None]


def test_no_llm_call_no_transition() -> None:
    result = build_batch(ended(), [rollout_root(), span("tool", 10, 20, "rollout")], BuildOptions())
    assert result.batch.transitions == [] and result.span_count == 2
    assert build_batch(ended(), [], BuildOptions()).batch.transitions == []


def test_a_call_that_cannot_be_a_transition_is_skipped_and_the_rest_reindexed() -> None:
    spans = three_calls_with_a_reward()
    broken = call("c2", 200, 300, "agent")
    spans[4] = type(broken)(**{**{f: getattr(broken, f) for f in broken.__slots__}, "span_id": "not-hex"})
    result = build_batch(ended(reward=1.0), spans, BuildOptions())
    assert [t.span_id for t in result.batch.transitions] == [sid("c1"), sid("c3")]
    assert [t.intermediate_reward for t in result.batch.transitions] == [0.2, None]
    assert len(result.skipped) == 1 and "span_id" in result.skipped[0]


def test_only_finished_rollouts_are_built() -> None:
    with pytest.raises(ValueError, match="not finished"):
        running = RolloutEvent(rollout_id="r1", attempt=1, status=RolloutStatus.RUNNING, task_id="t", group_id="g")
        build_batch(running, [], BuildOptions())


def test_options_refuse_bad_patterns() -> None:
    with pytest.raises(ConfigurationError, match="regular expression"):
        BuildOptions.create(agent_pattern="(")


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FULMEN_TRANSITIONS_AGENT_PATTERN", "write|rewrite")
    assert ConsumersSettings().transitions.agent_pattern == "write|rewrite"


def test_credit_settings_on_the_consumer_say_where_they_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FULMEN_TRANSITIONS_CREDIT", "intermediate")
    with pytest.raises(ValueError, match="FULMEN_TRANSITIONS_CREDIT.*FULMEN_TRAIN_CREDIT"):
        ConsumersSettings()


# --- window and attempts ---------------------------------------------------------------------------------------
TP = TopicPartition("fulmen.rollouts", 0)


def record(offset: int) -> ConsumerRecord:
    return ConsumerRecord("fulmen.rollouts", 0, offset, 0, 0, b"r1", b"{}", None, 2, 2, [])


def test_offsets_commit_in_order_once_done_and_past_their_window() -> None:
    window = BuildWindow()
    for offset in range(4):
        window.read(TP, offset)
    window.done(TP, 0, ready_at=1.0)
    window.built(Built(ended(), 5, ended().timestamp, TP, record(1)), ready_at=10.0)
    window.done(TP, 2, ready_at=1.0)
    assert window.committable(now=2.0) == {TP: 1}  # 1 is still in its late window, 3 not done
    assert window.committable(now=2.0) == {TP: 1}  # offered again until a commit of it went out
    window.committed({TP: 1})
    assert window.has_built(("r1", 1)) and list(window.watched()) == [("r1", 1)]
    window.done(TP, 3, ready_at=1.0)
    assert window.committable(now=5.0) == {}
    assert window.committable(now=10.0) == {TP: 4}
    assert not window.watched() and window.pending() == 0


def test_a_commit_stops_watching_exactly_the_rollouts_below_it() -> None:
    window = BuildWindow()
    other = TopicPartition("fulmen.rollouts", 1)
    for offset in range(6):
        window.read(TP, offset)
        window.read(other, offset)
    for offset in (4, 0, 2):  # built out of offset order
        event = ended().model_copy(update={"rollout_id": f"r{offset}"})
        window.built(Built(event, 0, event.timestamp, TP, record(offset)), ready_at=1.0)
    event = ended().model_copy(update={"rollout_id": "elsewhere"})
    window.built(Built(event, 0, event.timestamp, other, record(0)), ready_at=9.0)
    window.unwatch(("r2", 1))  # a late span rebuilt it: built again at a later offset
    rebuilt = ended().model_copy(update={"rollout_id": "r2"})
    window.built(Built(rebuilt, 1, rebuilt.timestamp, TP, record(5)), ready_at=9.0)
    for offset in (1, 3):
        window.done(TP, offset, ready_at=1.0)
    assert window.committable(now=2.0) == {TP: 5}
    # r2's first build (offset 2) is below the commit, its second (offset 5) is not; the other partition's rollout
    # is still in its window
    assert sorted(window.watched()) == [("elsewhere", 1), ("r2", 1)]
    assert window.committable(now=9.0) == {TP: 6, other: 1}
    assert not window.watched()


def test_a_revoked_partition_is_forgotten() -> None:
    window = BuildWindow()
    window.read(TP, 7)
    window.built(Built(ended(), 5, ended().timestamp, TP, record(7)), ready_at=10.0)
    window.forget([TP])
    assert not window.watched() and window.pending() == 0 and window.committable(now=99.0) == {}


def test_an_older_attempt_is_superseded_by_a_newer_one() -> None:
    tracker = AttemptTracker(capacity=2)
    first_failed = ended(RolloutStatus.FAILED, attempt=1)
    tracker.observe(first_failed)
    assert not tracker.superseded(first_failed)
    tracker.observe(RolloutEvent(rollout_id="r1", attempt=2, status=RolloutStatus.CLAIMED, task_id="t1", group_id="g"))
    assert tracker.superseded(first_failed) and not tracker.superseded(ended(attempt=2))
    for other in ("r2", "r3"):  # capacity 2: r1 is forgotten
        tracker.observe(
            RolloutEvent(rollout_id=other, attempt=1, status=RolloutStatus.CLAIMED, task_id="t", group_id="g")
        )
    assert not tracker.superseded(first_failed)


# --- barrier rounds and the late-span check --------------------------------------------------------------------
SPANS = [TopicPartition("otlp_spans", p) for p in range(2)]


def test_rounds_are_released_in_order_once_the_commits_reach_their_snapshot(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    rounds = WaitingRounds("fulmen.consumers.spans", warn_after_s=30, clock=lambda: now[0])
    rounds.add(["a"], {SPANS[0]: 5, SPANS[1]: 0})
    rounds.add(["b", "c"], {SPANS[0]: 5, SPANS[1]: 3})
    assert rounds.release({SPANS[0]: 4}) == [] and len(rounds) == 2
    assert rounds.release({SPANS[0]: 5}) == ["a"]  # partition 1 had nothing to wait for in the first round
    now[0] = 31.0
    assert rounds.release({SPANS[0]: 9, SPANS[1]: 2}) == []
    assert "otlp_spans[1] by 1" in caplog.text and "waited 31s" in caplog.text
    assert rounds.release({SPANS[0]: 9, SPANS[1]: 3}) == ["b", "c"] and len(rounds) == 0


def test_behind_and_dropping_a_revoked_partition_s_items() -> None:
    assert behind({SPANS[0]: 5, SPANS[1]: 2}, {SPANS[0]: 2}) == {SPANS[0]: 3, SPANS[1]: 2}
    rounds = WaitingRounds("g")
    rounds.add([(TP, 1), (TopicPartition("fulmen.rollouts", 3), 2)], {})
    assert rounds.drop(lambda item: item[0] != TP) == [(TP, 1)]
    assert rounds.release({}) == [(TopicPartition("fulmen.rollouts", 3), 2)]


class FakeReader:
    def __init__(self) -> None:
        self.clock_ms = 100_000
        self.ingested: dict[tuple[str, int], list[int]] = {}  # rollout -> IngestedAt of each span
        self.asked_since: list[int] = []

    def now_ms(self) -> int:
        return self.clock_ms

    def recently_ingested(self, rollout_ids: set[str], since_ms: int) -> set[tuple[str, int]]:
        self.asked_since.append(since_ms)
        return {key for key, times in self.ingested.items() if key[0] in rollout_ids and max(times) >= since_ms}

    def span_counts(self, keys: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        return {key: len(self.ingested[key]) for key in keys}


def test_the_late_check_finds_watched_rollouts_that_grew() -> None:
    now = [0.0]
    reader = FakeReader()
    check = LateSpanCheck(reader, window_s=60, interval_s=2, clock=lambda: now[0])  # type: ignore[arg-type]
    built = Built(ended(), 2, ended().timestamp, TP, record(1))
    reader.ingested = {("r1", 1): [99_000, 99_500], ("other", 1): [99_900]}
    assert check.due() and check.late({("r1", 1): built}) == {}
    assert not check.due()  # the next one is 2 s later
    reader.clock_ms, now[0] = 102_000, 2.0
    reader.ingested[("r1", 1)].append(101_000)  # a late span
    assert check.due() and check.late({("r1", 1): built}) == {("r1", 1): 3}
    assert reader.asked_since == [100_000 - 60_000 - SLACK_MS, 100_000 - SLACK_MS]
    assert not LateSpanCheck(reader, window_s=0, interval_s=1).due()  # type: ignore[arg-type]
