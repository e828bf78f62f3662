"""The dispatcher and the training loop with fakes at the edges: a publisher that answers each dispatched request
with a transition batch in an in-memory consumer, and a trainer backend that records its steps."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from fulmen.algorithm.service.collector import Collector
from fulmen.algorithm.service.dispatcher import DatasetTask, Dispatcher
from fulmen.algorithm.service.groups import GroupBook
from fulmen.algorithm.service.loop import LoopPlan, TrainingLoop
from fulmen.algorithm.service.run import latest_checkpoint
from fulmen.algorithm.settings import TrainSection, TrainSettings
from fulmen.algorithm.trainer.base import StepMetrics
from fulmen.schemas.codec import encode
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import (
    ModelVersion,
    RolloutMode,
    RolloutRequest,
    RolloutStatus,
    TrainStep,
    Transition,
    TransitionBatch,
)
from fulmen.schemas.task_file import load_task_file
from fulmen.schemas.topics import TopicKey
from tests.fakes import FakeConsumer

TOPIC = "fulmen.transitions"
Answer = Callable[[RolloutRequest, int], TransitionBatch | None]


class FakePublisher:
    """Records events; answers each task request through ``answer`` into the fake transitions consumer."""

    def __init__(self, source: FakeConsumer, answer: Answer) -> None:
        self.events: dict[TopicKey, list] = {key: [] for key in TopicKey}
        self.source = source
        self.answer = answer

    async def publish(self, key: TopicKey, event) -> None:
        await self.publish_many(key, [event])

    async def publish_many(self, key: TopicKey, events) -> None:
        for event in events:
            self.events[key].append(event)
            if key is TopicKey.TASKS:
                reply = self.answer(event, len(self.events[key]))
                if reply is not None:
                    self.source.append(TOPIC, 0, encode(reply), reply.group_id.encode())


class FakeBackend:
    def __init__(self) -> None:
        self.batches: list[list] = []

    def step(self, samples):
        self.batches.append(list(samples))
        return StepMetrics(
            step=len(self.batches),
            loss=0.5,
            grad_norm=1.0,
            tokens=10,
            input_tokens=20,
            tokens_per_s=100.0,
            train_s=0.2,
            clip_fraction=0.1,
        )

    def sft_step(self, samples):  # pragma: no cover - the loop must never call it
        raise AssertionError("the training loop takes RL steps only; sft_step is for warm-ups")

    def save(self, directory: Path | str) -> Path:
        Path(directory).mkdir(parents=True)
        return Path(directory)


def reply(request: RolloutRequest, number: int, *, version: int | None = None, reward: float | None = None):
    reward = float(number % 2) if reward is None else reward
    call = Transition(
        rollout_id=request.rollout_id,
        attempt=1,
        index=0,
        trace_id="b" * 32,
        span_id="c" * 16,
        model_version=request.model_version if version is None else version,
        prompt_token_ids=[1, 2],
        response_token_ids=[3, 4, 5],
        reward=reward,
    )
    return TransitionBatch(
        rollout_id=request.rollout_id,
        attempt=1,
        task_id=request.task_id,
        group_id=request.group_id,
        mode=request.mode,
        status=RolloutStatus.SUCCEEDED,
        episode_reward=reward,
        model_version=call.model_version,
        transitions=[call],
    )


def build(
    tmp_path: Path,
    answer: Answer = reply,
    val: list[DatasetTask] | None = None,
    initial_version: int = 0,
    **train: object,
):
    options = TrainSection(**{"steps": 2, "group_size": 2, "groups_per_step": 2, "run_id": "r1", **train})
    source = FakeConsumer()
    publisher = FakePublisher(source, answer)
    backend = FakeBackend()
    tasks = [DatasetTask(f"t{i}", {"n": i}) for i in range(3)]
    collector = Collector(source, GroupBook(timeout_s=60, policy=options.incomplete_policy), poll_timeout_ms=0)
    train_dispatcher = Dispatcher(
        publisher,
        tasks,
        group_size=options.group_size,  # type: ignore[arg-type]
        max_in_flight=options.groups_in_flight,
    )
    val_dispatcher = (
        Dispatcher(publisher, val, group_size=1, max_in_flight=2, mode=RolloutMode.VAL, cycle=False)  # type: ignore[arg-type]
        if val
        else None
    )
    loop = TrainingLoop(
        LoopPlan(options, tmp_path, "base", initial_version),
        backend,
        publisher,
        collector,  # type: ignore[arg-type]
        train_dispatcher,
        val_dispatcher,
    )
    return loop, publisher, backend, source


def run(loop: TrainingLoop, stop: asyncio.Event | None = None) -> list[TrainStep]:
    return asyncio.run(asyncio.wait_for(loop.run(stop), 30))


def test_each_step_trains_publishes_a_version_then_its_metrics_then_commits(tmp_path: Path) -> None:
    loop, publisher, backend, source = build(tmp_path, steps=3)
    steps = run(loop)
    versions: list[ModelVersion] = publisher.events[TopicKey.MODELS]
    assert [(v.version, v.uri, v.step) for v in versions] == [
        (n, str(tmp_path / "checkpoints" / f"v{n}"), n) for n in (1, 2, 3)
    ]
    assert publisher.events[TopicKey.METRICS] == steps and [s.step for s in steps] == [1, 2, 3]
    assert [len(batch) for batch in backend.batches] == [4, 4, 4]  # 2 groups x 2 rollouts x 1 call
    assert all(s.kl is None and s.loss == 0.5 and s.num_groups == 2 for s in steps)
    requests: list[RolloutRequest] = publisher.events[TopicKey.TASKS]
    # 4 groups in flight at version 0 fed steps 1 and 2; step 3 refilled at version 2
    assert [r.model_version for r in requests] == [0] * 8 + [2] * 8
    assert len(publisher.events[TopicKey.ROLLOUTS]) == len(requests)  # each announced as queued
    assert sum(source.committed.values()) >= 12  # the 6 groups trained on are committed


def test_in_flight_groups_are_bounded_and_released_when_they_close(tmp_path: Path) -> None:
    loop, publisher, _, _ = build(tmp_path, answer=lambda r, n: None)  # nobody answers
    asyncio.run(loop.train.fill(0))
    asyncio.run(loop.train.fill(0))
    assert len(loop.train.in_flight) == 4 and len(publisher.events[TopicKey.TASKS]) == 8  # 2 * groups_per_step
    group_id = next(iter(loop.train.in_flight))
    assert loop.train.release(group_id).group_id == group_id
    [group] = asyncio.run(loop.train.fill(0))
    assert group.size == 2 and len(set(group.rollout_ids)) == 2 and loop.train.passes == 2  # 3 tasks: a new pass


def test_stale_transitions_are_dropped_and_their_group_replaced(tmp_path: Path) -> None:
    def answer(request: RolloutRequest, number: int) -> TransitionBatch:
        return reply(request, number, version=0 if number <= 2 else None)  # the first group: sampled by v0

    # version 1 is served (a resumed run): v0 is one version too old
    loop, _, backend, _ = build(tmp_path, answer=answer, initial_version=1, steps=2, max_staleness=0)
    [step] = run(loop)
    assert step.dropped_stale == 2 and step.num_groups == 2 and len(backend.batches[0]) == 4


def test_validation_accuracy_counts_episode_rewards_above_one_half(tmp_path: Path) -> None:
    def answer(request: RolloutRequest, number: int) -> TransitionBatch:
        if request.mode is RolloutMode.VAL:
            return reply(request, number, reward=1.0 if request.task_id == "v0" else 0.5)
        return reply(request, number)

    val = [DatasetTask("v0", {"n": 0}), DatasetTask("v1", {"n": 1})]
    loop, _, _, _ = build(tmp_path, answer=answer, val=val)
    first, last = run(loop)
    assert (first.extra["initial_val_accuracy"], first.extra["initial_val_reward_mean"]) == (0.5, 0.75)
    assert "val_accuracy" not in first.extra and last.extra["val_accuracy"] == 0.5  # after the last step


def test_validation_runs_again_what_an_older_version_served(tmp_path: Path) -> None:
    """The gateway loads a version a moment after it is published: the first validation rollouts after step 2
    are served by version 1 (reward 0); they are not counted but run again, and what version 2 serves counts."""
    served_before = {"count": 0}

    def answer(request: RolloutRequest, number: int) -> TransitionBatch:
        if request.mode is RolloutMode.VAL and request.model_version == 2 and served_before["count"] < 1:
            served_before["count"] += 1
            return reply(request, number, version=1, reward=0.0)
        if request.mode is RolloutMode.VAL:
            return reply(request, number, reward=1.0)
        return reply(request, number)

    val = [DatasetTask("v0", {"n": 0}), DatasetTask("v1", {"n": 1})]
    loop, publisher, _, _ = build(tmp_path, answer=answer, val=val)
    _, last = run(loop)
    assert last.extra["val_accuracy"] == 1.0 and last.extra["val_redone"] == 1.0
    val_requests = [r for r in publisher.events[TopicKey.TASKS] if r.mode is RolloutMode.VAL]
    assert [r.task_id for r in val_requests if r.model_version == 2] == ["v0", "v1", "v0"]


def test_a_set_stop_ends_the_run_before_a_step(tmp_path: Path) -> None:
    loop, publisher, backend, _ = build(tmp_path)
    stop = asyncio.Event()
    stop.set()
    assert run(loop, stop) == [] and backend.batches == [] and publisher.events[TopicKey.MODELS] == []


def test_zero_steps_validate_the_served_model_once_and_train_nothing(tmp_path: Path) -> None:
    val = [DatasetTask(f"v{i}", {"n": i}) for i in range(2)]
    loop, publisher, backend, _ = build(tmp_path, val=val, steps=0)
    assert run(loop) == [] and backend.batches == [] and publisher.events[TopicKey.MODELS] == []
    requests: list[RolloutRequest] = publisher.events[TopicKey.TASKS]
    assert sorted(r.task_id for r in requests) == ["v0", "v1"] and {r.mode for r in requests} == {RolloutMode.VAL}
    with pytest.raises(ValueError, match="steps=0"):  # with steps to take, something must be trained on
        TrainingLoop(
            LoopPlan(TrainSection(steps=1, run_id="r1"), tmp_path, "base", 0),
            backend,
            publisher,  # type: ignore[arg-type]
            loop.collector,
            None,
            None,
        )
    TrainingLoop(
        LoopPlan(TrainSection(steps=0, run_id="r1"), tmp_path, "base", 0),
        backend,
        publisher,  # type: ignore[arg-type]
        loop.collector,
        None,
        None,
    )


def test_a_task_file_is_dispatched_with_the_runs_own_request_settings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tasks.jsonl"
    lines = [{"q": 1}, {"input": {"q": 2}, "task_id": "two", "metadata": {"k": "v"}, "timeout_s": 5, "mode": "val"}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    publisher = FakePublisher(FakeConsumer(), lambda r, n: None)
    dispatcher = Dispatcher(
        publisher,
        load_task_file(path),
        group_size=2,
        max_in_flight=2,
        rollout_timeout_s=60,  # type: ignore[arg-type]
        max_attempts=2,
        metadata={"agent": "a:b"},
    )
    assert "1 task(s) set mode/timeout_s (lines 2)" in caplog.text  # the run's settings win, and it says so
    asyncio.run(dispatcher.fill(0))
    requests: list[RolloutRequest] = publisher.events[TopicKey.TASKS]
    assert [r.task_id for r in requests][2:] == ["two", "two"] and requests[0].task_id.startswith("t-")
    assert {(r.mode, r.timeout_s, r.max_attempts) for r in requests} == {(RolloutMode.TRAIN, 60, 2)}
    assert requests[2].metadata == {"agent": "a:b", "k": "v"} and requests[2].input == {"q": 2}


def test_a_resumed_run_continues_its_numbering_up_to_its_last_step(tmp_path: Path) -> None:
    for name in ("v1", "v2", "v10x", "v3"):  # v3 has no model in it, v10x is not a version
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    for name in ("v1", "v2", "v10x"):
        (tmp_path / "checkpoints" / name / "config.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == (2, tmp_path / "checkpoints" / "v2")
    assert latest_checkpoint(tmp_path / "elsewhere") is None
    loop, publisher, _, _ = build(tmp_path / "resumed", initial_version=2, steps=3)
    [step] = run(loop)
    assert step.step == 3 and [v.version for v in publisher.events[TopicKey.MODELS]] == [3]
    assert {r.model_version for r in publisher.events[TopicKey.TASKS]} == {2}


def test_train_settings_come_from_fulmen_train_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name, value in {
        "HOME": str(tmp_path),
        "TRAIN_GROUP_SIZE": "4",
        "TRAIN_INCOMPLETE_POLICY": "drop",
        "TRAIN_MAX_STALENESS": "0",
        "TRAIN_ESTIMATOR": "rloo",
        "TRAIN_RUN_ID": "r-7",
    }.items():
        monkeypatch.setenv(f"FULMEN_{name}", value)
    settings = TrainSettings()
    train = settings.train
    assert (train.group_size, train.incomplete_policy, train.max_staleness, train.estimator) == (4, "drop", 0, "rloo")
    assert settings.run_dir == tmp_path / "runs" / "r-7" and train.groups_in_flight == 2 * train.groups_per_step
    assert train.group_deadline_s == 600 * 3 + 72 * 2 + 60  # every attempt may time out, each retry back off
    monkeypatch.setenv("FULMEN_TRAIN_MIN_GROUP_SIZE", "5")
    with pytest.raises(ValueError, match="min_group_size"):
        TrainSettings()
    monkeypatch.setenv("FULMEN_TRAIN_MIN_GROUP_SIZE", "2")
    monkeypatch.setenv("FULMEN_TRAIN_AGENT", "not an agent")
    with pytest.raises(ValueError, match="agent"):
        TrainSettings()


def task_of_group(publisher: FakePublisher) -> dict[str, str]:
    return {r.group_id: r.task_id for r in publisher.events[TopicKey.TASKS]}


def test_dynamic_sampling_trains_only_on_groups_whose_rewards_differ(tmp_path: Path) -> None:
    def answer(request: RolloutRequest, number: int) -> TransitionBatch:  # task t0 is always solved: no signal
        return reply(request, number, reward=1.0 if request.task_id == "t0" else None)

    loop, publisher, backend, _ = build(tmp_path, answer=answer, steps=3, dynamic_sampling=True)
    steps = run(loop)
    tasks = task_of_group(publisher)
    trained = [{tasks[s.group_id] for s in batch} for batch in backend.batches]
    assert all("t0" not in batch for batch in trained) and all(s.num_groups == 2 for s in steps)
    skipped = [s.extra["filtered_groups"] for s in steps]
    dispatched_t0 = sum(task == "t0" for task in tasks.values())
    assert sum(skipped) >= 1 and steps[-1].extra["filtered_groups_total"] == sum(skipped)
    assert sum(skipped) <= dispatched_t0 and all(s.extra["dynamic_sampling_exhausted"] == 0 for s in steps)
    plain_loop, plain_publisher, plain_backend, _ = build(tmp_path / "plain", answer=answer, steps=3)
    run(plain_loop)
    plain_tasks = task_of_group(plain_publisher)
    assert any(plain_tasks[s.group_id] == "t0" for batch in plain_backend.batches for s in batch)
    assert "filtered_groups" not in plain_publisher.events[TopicKey.METRICS][0].extra


def test_dynamic_sampling_waits_a_bounded_number_of_groups(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    loop, _, backend, _ = build(
        tmp_path,
        answer=lambda r, n: reply(r, n, reward=0.5),
        steps=1,
        dynamic_sampling=True,
        dynamic_sampling_max_skipped=3,
    )
    [step] = run(loop)
    assert step.extra["filtered_groups"] == 3 and step.extra["dynamic_sampling_exhausted"] == 1
    assert step.num_groups == 2 and len(backend.batches[0]) == 4  # then it took groups as they came
    assert "skipped 3 groups without signal" in caplog.text
    assert TrainSection(dynamic_sampling=True, groups_per_step=4).dynamic_sampling_bound == 40
    assert TrainSection(dynamic_sampling_max_skipped=7).dynamic_sampling_bound == 0  # off


def test_overlong_shaping_enters_the_advantages_and_is_counted(tmp_path: Path) -> None:
    def answer(request: RolloutRequest, number: int) -> TransitionBatch:  # 3 response tokens each, equal rewards
        return reply(request, number, reward=1.0)

    # a limit of 4 tokens with a ramp of 2: 3 tokens cost 0.5; every answer the same: no advantage either way
    loop, _, backend, _ = build(
        tmp_path, answer=answer, steps=1, overlong_shaping=True, overlong_max_tokens=4, overlong_buffer_tokens=2
    )
    [step] = run(loop)
    assert step.extra["overlong_penalized"] == 4 and step.reward_mean == 1.0  # rewards reported unshaped
    assert [s.advantage for s in backend.batches[0]] == [0.0] * 4
    with pytest.raises(ConfigurationError, match="set FULMEN_TRAIN_OVERLONG_MAX_TOKENS"):
        build(tmp_path / "dapo", algorithm="dapo")


def test_importance_weight_statistics_reach_the_train_step(tmp_path: Path) -> None:
    class CorrectedBackend(FakeBackend):
        def step(self, samples):
            metrics = super().step(samples)
            return dataclasses.replace(
                metrics,
                is_weight_mean=0.9,
                is_weight_max=2.0,
                is_ratio_max=3.5,
                is_truncated_fraction=0.1,
                is_masked_fraction=0.0,
            )

    loop, _, _, _ = build(tmp_path, steps=1)
    loop.backend = CorrectedBackend()
    [step] = run(loop)
    assert {k: v for k, v in step.extra.items() if k.startswith("is_")} == {
        "is_weight_mean": 0.9,
        "is_weight_max": 2.0,
        "is_ratio_max": 3.5,
        "is_truncated_fraction": 0.1,
        "is_masked_fraction": 0.0,
    }
    [plain] = run(build(tmp_path / "plain", steps=1)[0])
    assert not any(k.startswith("is_") for k in plain.extra)  # no correction, no statistics


class SlowBackend(FakeBackend):
    """A backend whose update takes ``seconds`` (in the loop's worker thread), noting how many task requests
    had been published when each update started and ended."""

    def __init__(self, publisher: FakePublisher, seconds: float) -> None:
        super().__init__()
        self.publisher = publisher
        self.seconds = seconds
        self.requests_seen: list[tuple[int, int]] = []

    def step(self, samples):
        import time

        before = len(self.publisher.events[TopicKey.TASKS])
        time.sleep(self.seconds)
        self.requests_seen.append((before, len(self.publisher.events[TopicKey.TASKS])))
        return super().step(samples)


def build_slow(tmp_path: Path, seconds: float, **train: object):
    loop, publisher, _, _ = build(tmp_path, **train)
    loop.backend = SlowBackend(publisher, seconds)
    return loop, publisher, loop.backend


def test_async_mode_keeps_max_staleness_steps_of_rollouts_ahead_of_training(tmp_path: Path) -> None:
    """Rollouts answer at once here, so the feeder is always at its bound: when update k starts (version k is
    served) rollouts for at least k + max_staleness steps are out (sync mode: at most k + 2), and never more than
    k + max_staleness + 1 steps' worth, so nothing goes stale."""
    loop, _, backend = build_slow(tmp_path, 0.3, steps=4, mode="async", max_staleness=2)
    assert loop.options.groups_in_flight == 6 and loop.options.correction == "tis"  # (2 + 1) x 2 groups; tis
    steps = run(loop)
    assert len(steps) == 4
    per_step = 2 * 2  # groups_per_step x group_size requests
    for version, (before, after) in enumerate(backend.requests_seen):
        assert before >= (version + 2) * per_step and after <= (version + 3) * per_step, backend.requests_seen
    assert backend.requests_seen[0][0] > 2 * per_step  # more ahead than the synchronous window
    assert all(s.dropped_stale == 0 for s in steps)
    for step in steps:
        ages = {
            int(k.split("_")[1]): v
            for k, v in step.extra.items()
            if k.startswith("staleness_") and k.split("_")[1].isdigit()
        }
        assert sum(ages.values()) == step.num_transitions and max(ages) <= 2 == loop.options.max_staleness
        assert step.extra["staleness_max"] == max(ages)


def test_sync_mode_dispatches_nothing_while_a_step_trains(tmp_path: Path) -> None:
    loop, _, backend = build_slow(tmp_path, 0.2, steps=3)
    steps = run(loop)
    assert len(steps) == 3 and loop.options.correction == ""
    assert all(after == before for before, after in backend.requests_seen), backend.requests_seen
    assert all(s.extra["staleness_max"] <= 1 for s in steps)


def test_async_mode_stops_its_feeder_when_the_run_ends(tmp_path: Path) -> None:
    loop, publisher, _ = build_slow(tmp_path, 0.05, steps=2, mode="async")

    async def main() -> int:
        await loop.run()
        dispatched = len(publisher.events[TopicKey.TASKS])
        await asyncio.sleep(0.3)  # a feeder still running would dispatch again as groups are taken
        return len(publisher.events[TopicKey.TASKS]) - dispatched

    assert asyncio.run(asyncio.wait_for(main(), 30)) == 0


@pytest.mark.multiagent
def test_per_agent_adapters_train_their_agents_calls_and_publish_a_version_per_adapter(tmp_path: Path) -> None:
    """Per-agent adapters: the base and each adapter's initial state are version 0; every step trains only the
    calls of the agents with an adapter (each sample says whose) and publishes one version per adapter."""

    def two_agents(request: RolloutRequest, number: int) -> TransitionBatch:
        calls = [
            Transition(
                rollout_id=request.rollout_id,
                attempt=1,
                index=i,
                trace_id="b" * 32,
                span_id="c" * 16,
                agent_name=agent,
                model_version=request.model_version,
                prompt_token_ids=[1, 2 + i],
                response_token_ids=[3, 4],
            )
            for i, agent in enumerate(("write", "check", "rewrite"))
        ]
        return TransitionBatch(
            rollout_id=request.rollout_id,
            attempt=1,
            task_id=request.task_id,
            group_id=request.group_id,
            mode=request.mode,
            status=RolloutStatus.SUCCEEDED,
            episode_reward=float(number % 2),
            model_version=request.model_version,
            transitions=calls,
        )

    loop, publisher, backend, _ = build(
        tmp_path, two_agents, adapters="per_agent", adapter_agents="write,rewrite", publish_initial_version=True
    )
    steps = run(loop)
    versions: list[ModelVersion] = publisher.events[TopicKey.MODELS]
    assert [(v.version, v.adapter, v.format) for v in versions] == [
        (0, "", "hf"),
        (0, "write", "hf_lora_adapter"),
        (0, "rewrite", "hf_lora_adapter"),
        (1, "write", "hf_lora_adapter"),
        (1, "rewrite", "hf_lora_adapter"),
        (2, "write", "hf_lora_adapter"),
        (2, "rewrite", "hf_lora_adapter"),
    ]
    assert versions[3].uri == str(tmp_path / "checkpoints" / "v1" / "write") and versions[3].base_model == "base"
    assert [sorted(s.agent for s in batch) for batch in backend.batches] == [["rewrite"] * 4 + ["write"] * 4] * 2
    assert all(s.extra["dropped_other_agents"] == 4.0 for s in steps)  # the four rollouts' check calls
