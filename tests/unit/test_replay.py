"""Replay from stored rows (``fulmen.algorithm.service.replay``): groups, the batch baseline for rollouts without a group,
late feedback (latest wins, call vs episode), refusals by reason, and the training loop taking replayed groups
(alone, or mixed with dispatched ones by ``replay_fraction``)."""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from fulmen.algorithm.service.collector import Collector
from fulmen.algorithm.service.dispatcher import DatasetTask, Dispatcher
from fulmen.algorithm.service.groups import GroupBook, credit_groups
from fulmen.algorithm.service.loop import LoopPlan, TrainingLoop
from fulmen.algorithm.service.replay import ReplayRows, build_buffer, load_replay
from fulmen.algorithm.service.samples import build_samples
from fulmen.algorithm.settings import TrainSection
from fulmen.infra.store.reads import QueryResult
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.topics import TopicKey
from tests.fakes import FakeConsumer
from tests.unit.test_train_loop import FakeBackend, FakePublisher, reply

pytestmark = pytest.mark.continuous

T0 = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


def row(
    rollout: str,
    group: str = "g1",
    *,
    attempt: int = 1,
    call: int = 0,
    version: int | None = 0,
    reward: float | None = None,
    episode: float | None = 1.0,
    span: str | None = None,
    at: int = 0,
    prompt: list[int] | None = None,
    logprobs: list[float] | None = None,
) -> dict[str, Any]:
    return {
        "RolloutId": rollout,
        "Attempt": attempt,
        "TaskId": f"task-{group}",
        "GroupId": group,
        "Mode": "train",
        "Status": "succeeded",
        "CallIndex": call,
        "TraceId": "a" * 32,
        "SpanId": span or f"{call:016x}",
        "AgentName": "",
        "ModelVersion": version,
        "PromptTokenIds": prompt or [1, 2, 3],
        "ResponseTokenIds": [4, 5],
        "ResponseLogprobs": logprobs if logprobs is not None else [-0.5, -0.25],
        "Reward": reward,
        "IntermediateReward": None,
        "EpisodeReward": episode,
        "CreatedAt": T0 + dt.timedelta(seconds=at),
    }


def buffer_of(transitions: list[dict[str, Any]], **rows: Any):
    selected = rows.pop("selected", sorted({r["RolloutId"] for r in transitions}))
    options = {"base_model": "base", "vocab_size": 100, "group_size": 2} | rows.pop("options", {})
    return build_buffer(ReplayRows(selected=selected, transitions=transitions, **rows), **options)


def test_rollouts_keep_their_group_in_stored_order_and_only_the_latest_attempt() -> None:
    buffer = buffer_of(
        [
            row("r3", "g2", at=5),
            row("r4", "g2", at=6, episode=0.0),
            row("r1", "g1", at=1),
            row("r2", "g1", attempt=1, at=2, episode=0.0),
            row("r2", "g1", attempt=2, at=3),
        ]
    )
    assert [g.group_id for g in buffer.groups] == ["g1", "g2"]  # by their earliest stored transition
    first = buffer.groups[0]
    assert [(b.rollout_id, b.attempt, b.episode_reward) for b in first.rollouts] == [("r1", 1, 1.0), ("r2", 2, 1.0)]
    assert first.task_id == "task-g1" and buffer.rollouts == 4 and buffer.transitions == 4
    call = first.rollouts[0].transitions[0]
    assert call.response_logprobs == [-0.5, -0.25] and call.model_version == 0  # behaviour logprobs and version kept
    # cycling: after the last group the first comes again
    assert [buffer.take().group_id for _ in range(3)] == ["g1", "g2", "g1"] and buffer.passes == 1


def test_rollouts_without_a_group_form_batches_of_group_size_whose_mean_is_the_baseline() -> None:
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0]
    buffer = buffer_of([row(f"p{i}", "", at=i, episode=r) for i, r in enumerate(rewards)])
    assert [len(g.rollouts) for g in buffer.groups] == [2, 2, 1]  # group_size 2, in stored order
    assert [[b.rollout_id for b in g.rollouts] for g in buffer.groups] == [["p0", "p1"], ["p2", "p3"], ["p4"]]
    data = build_samples(buffer.groups[:1], estimator="grpo")
    # the batch's own mean (0.5) is the baseline: +1 for the good answer, -1 for the bad one (GRPO's std scaling)
    assert [round(a, 3) for a in data.advantages] == [pytest.approx(0.707, abs=1e-3), pytest.approx(-0.707, abs=1e-3)]


def test_late_feedback_replaces_the_recorded_rewards_latest_per_target_and_episode_vs_call() -> None:
    rows = [row("r1", episode=None, reward=0.0, span="1" * 16), row("r2", episode=0.0)]
    feedback = {("r1", "1" * 16): 0.75, ("r2", ""): 1.0}  # what the store's argMax(Value, Timestamp) returned
    buffer = buffer_of(rows, feedback=feedback)
    r1, r2 = buffer.groups[0].rollouts
    assert r1.episode_reward is None and r1.transitions[0].intermediate_reward == 0.75  # it scores that call
    assert r2.episode_reward == 1.0  # a rollout's feedback replaces the episode reward
    assert buffer.feedback_applied == 2
    credited = credit_groups(buffer.groups, "intermediate")[0].rollouts[0].transitions[0]
    assert credited.reward == 0.75  # what the trainer sees of the call: the late reward, credited


def test_refusals_are_counted_by_reason() -> None:
    rows = [
        row("ok"),
        row("silent", episode=None),  # no reward at all: refused
        row("alien", prompt=[1, 500]),  # a token id outside this model's vocabulary (100): another base model
        row("old", version=3),  # served by version 3 of another base model
    ]
    buffer = buffer_of(
        rows,
        selected=["ok", "silent", "alien", "old", "gone", "openai"],
        no_token_ids={"openai": 2},
        version_bases={3: {"other-base"}, 0: {"base"}},
    )
    assert buffer.refused == {"no_token_ids": 2, "no_reward": 1, "other_base_model": 2, "not_found": 1}
    assert [b.rollout_id for g in buffer.groups for b in g.rollouts] == ["ok"]
    assert "2 other base model" in buffer.summary() and "1 not found" in buffer.summary()


class RowsReader:
    """A store reader answering replay's queries from canned results, recording what was asked."""

    def __init__(self, selection: QueryResult, transitions: list[dict[str, Any]]) -> None:
        self.selection = selection
        self.transitions = transitions
        self.asked: list[tuple[str, Any]] = []

    def query(self, sql: str, parameters: Any = None, *, final: bool = True, read_only: bool = True) -> QueryResult:
        assert final and read_only  # replay reads through the read-only guard, deduplicated
        assert parameters is None or isinstance(parameters, dict)  # values travel as bound parameters
        self.asked.append((sql, parameters))
        if "FROM fulmen.transitions" in sql:
            columns = list(self.transitions[0]) if self.transitions else ["RolloutId"]
            return QueryResult(columns, [list(r.values()) for r in self.transitions])
        if any(f"FROM fulmen.{table}" in sql for table in ("otel_traces", "feedback", "model_versions")):
            return QueryResult(["a", "b"], [])
        return self.selection


def test_a_second_column_orders_the_groups_by_their_smallest_value() -> None:
    transitions = [row("r1", "g1", at=1), row("r2", "g1", at=2), row("r3", "g2", at=3), row("r4", "g3", at=4)]
    buffer = buffer_of(transitions, order={"r1": 7.0, "r2": 2.0, "r3": 5.0})
    # g1 by its smallest key (2), then g2 (5); g3 has no key: after every ordered group, in stored order
    assert [g.group_id for g in buffer.groups] == ["g1", "g2", "g3"]
    buffer = buffer_of(transitions, order={"r1": 9.0, "r3": 1.0, "r4": 4.0})
    assert [g.group_id for g in buffer.groups] == ["g2", "g3", "g1"]


def test_load_replay_reads_the_order_column_and_refuses_one_that_is_not_numbers() -> None:
    options = {
        "database": "fulmen",
        "model_name": "fulmen",
        "base_model": "base",
        "vocab_size": None,
        "group_size": 2,
    }
    ordered = RowsReader(
        QueryResult(["RolloutId", "Position"], [["r1", 3], ["r3", 1], ["r1", 2]]),
        [row("r1", "g1", at=1), row("r3", "g2", at=2)],
    )
    buffer = load_replay(ordered, "SELECT RolloutId, Position FROM t", **options)
    assert [g.group_id for g in buffer.groups] == ["g2", "g1"]  # r1's smallest key is 2, r3's 1
    for value in ("late", None, float("nan")):
        bad = RowsReader(QueryResult(["RolloutId", "Position"], [["r1", value]]), [row("r1")])
        with pytest.raises(ConfigurationError, match=r"second column \(Position\).*finite numbers; rollout r1"):
            load_replay(bad, "SELECT RolloutId, Position FROM t", **options)


def test_load_replay_wants_one_or_two_columns_and_something_trainable() -> None:
    two = RowsReader(QueryResult(["RolloutId", "Reward", "Step"], [["r1", 1.0, 1]]), [])
    with pytest.raises(ConfigurationError, match="optionally a second column that orders them; it returns 3 col"):
        load_replay(
            two,
            "SELECT RolloutId, Reward, Step FROM fulmen.rollouts",
            database="fulmen",
            model_name="fulmen",
            base_model="base",
            vocab_size=None,
            group_size=2,
        )
    nothing = RowsReader(QueryResult(["RolloutId"], [["r9"]]), [])
    with pytest.raises(ConfigurationError, match="nothing to replay: 1 rollout.*1 not found"):
        load_replay(
            nothing,
            "SELECT RolloutId FROM fulmen.rollouts;",
            database="fulmen",
            model_name="fulmen",
            base_model="base",
            vocab_size=None,
            group_size=2,
        )
    ok = RowsReader(QueryResult(["RolloutId"], [["r1"], ["r2"]]), [row("r1"), row("r2", episode=0.0)])
    buffer = load_replay(
        ok,
        "SELECT RolloutId FROM fulmen.rollouts",
        database="fulmen",
        model_name="fulmen",
        base_model="base",
        vocab_size=None,
        group_size=2,
    )
    assert buffer.rollouts == 2 and ok.asked[1][1] == {"ids": ["r1", "r2"]}  # ids travel as bound parameters


def loop_with(tmp_path: Path, buffer, tasks: list[DatasetTask] | None, **train: object):
    options = TrainSection(**{"steps": 2, "group_size": 2, "groups_per_step": 2, "run_id": "r1", **train})
    source = FakeConsumer()
    publisher = FakePublisher(source, reply)
    backend = FakeBackend()
    collector = Collector(source, GroupBook(timeout_s=60, policy=options.incomplete_policy), poll_timeout_ms=0)
    dispatcher = Dispatcher(publisher, tasks, group_size=2, max_in_flight=options.groups_in_flight) if tasks else None  # type: ignore[arg-type]
    loop = TrainingLoop(
        LoopPlan(options, tmp_path, "base"),
        backend,
        publisher,
        collector,
        dispatcher,  # type: ignore[arg-type]
        replay=buffer,
    )
    return loop, publisher, backend


def two_groups():
    return buffer_of(
        [
            row("r1", "g1", at=1),
            row("r2", "g1", at=2, episode=0.0),
            row("r3", "g2", at=3),
            row("r4", "g2", at=4, episode=0.0),
        ]
    )


def test_a_replay_only_run_trains_on_the_buffer_and_dispatches_nothing(tmp_path: Path) -> None:
    buffer = two_groups()
    loop, publisher, backend = loop_with(tmp_path, buffer, None, steps=2, groups_per_step=2, max_staleness=5)
    steps = asyncio.run(asyncio.wait_for(loop.run(), 30))
    assert publisher.events[TopicKey.TASKS] == []  # no rollout was run
    assert [len(batch) for batch in backend.batches] == [4, 4]
    assert [s.extra["replayed_groups"] for s in steps] == [2.0, 2.0] and steps[1].extra["replay_passes"] == 2.0
    assert steps[0].extra["replay_refused_no_reward"] == 0.0
    assert all(s.old_logprobs == [-0.5, -0.25] for s in backend.batches[0])  # the stored behaviour logprobs
    assert [s.group_ids for s in steps] == [["g1", "g2"], ["g1", "g2"]]  # what each step trained on, recorded


def test_replay_fraction_mixes_replayed_and_dispatched_groups(tmp_path: Path) -> None:
    tasks = [DatasetTask(f"t{i}", {"n": i}) for i in range(3)]
    loop, publisher, _ = loop_with(
        tmp_path, two_groups(), tasks, steps=1, groups_per_step=4, replay_fraction=0.5, max_staleness=5
    )
    (step,) = asyncio.run(asyncio.wait_for(loop.run(), 30))
    assert step.extra["replayed_groups"] == 2.0 and step.num_groups == 4
    assert len(publisher.events[TopicKey.TASKS]) >= 4  # the other two groups were dispatched and run


def test_a_buffer_whose_groups_are_all_too_stale_ends_the_run_with_a_clear_error(tmp_path: Path) -> None:
    buffer = buffer_of([row("r1", "g1", version=0), row("r2", "g1", version=0, episode=0.0)])
    loop, _, _ = loop_with(tmp_path, buffer, None, steps=3, groups_per_step=1, max_staleness=0)
    with pytest.raises(ConfigurationError, match="no replayed group is trainable at model version 1"):
        asyncio.run(asyncio.wait_for(loop.run(), 30))


def test_replay_settings_default_to_the_tis_correction() -> None:
    assert TrainSection(replay_sql="SELECT 1").correction == "tis"
    assert TrainSection(replay_sql="SELECT 1", correction="mis").correction == "mis"
    assert TrainSection().correction == ""
    # what the trainer applies: none for '' and for 'none', which replay keeps (a replay of a run's own batches)
    assert TrainSection(replay_sql="SELECT 1").applied_correction == "tis"
    assert TrainSection().applied_correction is None
    chosen = TrainSection(replay_sql="SELECT 1", correction="none")
    assert chosen.correction == "none" and chosen.applied_correction is None
    chosen.replay_sql = "SELECT 2"  # re-checked after a change: still none
    assert TrainSection.model_validate(chosen.model_dump()).applied_correction is None
