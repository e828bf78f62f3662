"""Replay against the real store and broker: rollouts stored as ``fulmen consume`` stores them are selected with SQL
and trained on by ``run_trainer()`` (no rollout dispatched), the refusals counted; the selection goes through the
read-only guard; and ``fulmen train --replay`` tells what is wrong with a bad selection."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
from pathlib import Path

import pyarrow as pa
import pytest

from fulmen.algorithm.service.run import run_trainer
from fulmen.algorithm.settings import TrainSettings
from fulmen.consumers.event_sinks import TRANSITION_SCHEMA, transition_rows
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store
from fulmen.infra.store.sql_guard import ReadOnlyError
from fulmen.schemas import ModelVersion, RolloutStatus, TopicKey, TrainStep, Transition, TransitionBatch
from tests.integration.test_train_loop import FULMEN, VOCAB, read_topic

pytestmark = [pytest.mark.integration, pytest.mark.continuous]


def stored_batch(
    rng: random.Random, rollout: str, group: str, reward: float | None, *, too_big: bool = False
) -> TransitionBatch:
    response = [rng.randrange(VOCAB) for _ in range(4)]
    prompt = [rng.randrange(VOCAB) for _ in range(6)] + ([100_000] if too_big else [])
    call = Transition(
        rollout_id=rollout,
        attempt=1,
        index=0,
        trace_id=f"{rng.getrandbits(128):032x}",
        span_id=f"{rng.getrandbits(64):016x}",
        model_version=0,
        prompt_token_ids=prompt,
        response_token_ids=response,
        response_logprobs=[-1.0] * 4,
        reward=reward,
    )
    return TransitionBatch(
        rollout_id=rollout,
        attempt=1,
        task_id=f"task-{group}",
        group_id=group,
        status=RolloutStatus.SUCCEEDED,
        episode_reward=reward,
        model_version=0,
        transitions=[call],
    )


def fill(store: Store) -> None:
    """Two groups of four answered rollouts, one rollout without any reward, one of another vocabulary."""
    rng = random.Random(3)
    batches = [stored_batch(rng, f"r{g}{i}", f"g{g}", float(i % 2)) for g in range(2) for i in range(4)]
    batches += [stored_batch(rng, "silent", "g9", None), stored_batch(rng, "alien", "g9", 1.0, too_big=True)]
    rows = [row for batch in batches for row in transition_rows(batch)]
    store.insert_arrow("transitions", pa.Table.from_pylist(rows, schema=TRANSITION_SCHEMA))


def replay_settings(settings: FulmenSettings, tmp_path: Path, sql: str, **train: object) -> TrainSettings:
    data = settings.model_dump()
    data["train"] = {
        "run_id": "replay-run",
        "run_dir": tmp_path / "run",
        "model_path": "tiny",
        "steps": 2,
        "group_size": 4,
        "groups_per_step": 1,
        "device": "cpu",
        "micro_batch_size": 4,
        "replay_sql": sql,
        "max_staleness": 5,
        **train,
    }
    return TrainSettings.model_validate(data)


def test_train_replays_the_selected_stored_rollouts_and_counts_what_it_refused(
    settings: FulmenSettings, linked_store: Store, tmp_path: Path
) -> None:
    fill(linked_store)
    db = linked_store.database
    sql = f"SELECT DISTINCT RolloutId FROM {db}.transitions WHERE RolloutId != 'nothing' UNION ALL SELECT 'gone'"
    steps: list[TrainStep] = asyncio.run(run_trainer(replay_settings(settings, tmp_path, sql), [], None))
    assert [s.step for s in steps] == [1, 2] and all(s.num_groups == 1 and s.num_transitions == 4 for s in steps)
    assert steps[0].extra["replayed_groups"] == 1.0 and steps[1].extra["replay_passes"] == 1.0  # g0 then g1
    refused = {k: v for k, v in steps[0].extra.items() if k.startswith("replay_refused_")}
    assert refused == {
        "replay_refused_no_token_ids": 0.0,
        "replay_refused_no_reward": 1.0,
        "replay_refused_other_base_model": 1.0,
        "replay_refused_not_found": 1.0,
    }
    assert steps[0].extra["is_weight_mean"] > 0  # tis against the stored behaviour logprobs
    assert asyncio.run(read_topic(settings, TopicKey.TASKS, ModelVersion)) == []  # nothing was dispatched
    versions = asyncio.run(read_topic(settings, TopicKey.MODELS, ModelVersion))
    assert [v.version for v in versions] == [1, 2]


def test_the_selection_is_read_only_and_must_name_rollouts(
    settings: FulmenSettings, linked_store: Store, tmp_path: Path
) -> None:
    fill(linked_store)
    with pytest.raises(ReadOnlyError):
        asyncio.run(
            run_trainer(replay_settings(settings, tmp_path, f"DROP TABLE {linked_store.database}.transitions"), [])
        )
    empty = f"SELECT RolloutId FROM {linked_store.database}.transitions WHERE 0"
    with pytest.raises(Exception, match="nothing to replay: 0 rollout"):
        asyncio.run(run_trainer(replay_settings(settings, tmp_path, empty), []))


def test_fulmen_train_without_a_dataset_or_a_replay_says_what_to_pass(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {"FULMEN_HOME": str(tmp_path)}
    done = subprocess.run([*FULMEN, "train", "--model", "tiny"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "pass --dataset FILE or --tasks-sql SQL (tasks to run), or --replay SQL" in done.stdout + done.stderr


def test_tasks_sql_dispatches_the_stored_tasks_a_selection_names(
    settings: FulmenSettings, linked_store: Store, tmp_path: Path
) -> None:
    """Tasks stored as the tasks sink stores them (dispatched before), the ones that failed selected by SQL over the
    rollouts: a run dispatches exactly those, with their stored payloads, in groups of G."""
    from fulmen.consumers.event_sinks import EVENT_SINKS
    from fulmen.schemas import RolloutEvent, RolloutRequest
    from tests.integration.test_train_loop import simulated_runners

    requests = [
        RolloutRequest(task_id=f"t{n}", group_id=f"g{n}", input={"question": f"{n} + {n}", "n": n}) for n in range(4)
    ]
    outcomes = [
        RolloutEvent(
            rollout_id=r.rollout_id,
            attempt=1,
            status=RolloutStatus.SUCCEEDED,
            task_id=r.task_id,
            group_id=r.group_id,
            reward=float(n % 2),
        )
        for n, r in enumerate(requests)
    ]
    for name, events in (("tasks", requests), ("rollouts", outcomes)):
        sink = EVENT_SINKS[name]
        linked_store.insert_batch(sink.table, sink.to_batch([sink.rows(e) for e in events]))
    failed = f"SELECT TaskId FROM {linked_store.database}.rollouts WHERE Reward < 0.5 ORDER BY TaskId"
    options = replay_settings(settings, tmp_path, "", tasks_sql=failed, steps=1, group_size=2, groups_per_step=2)

    async def run() -> list[TrainStep]:
        stop = asyncio.Event()
        runners = asyncio.create_task(simulated_runners(settings, stop))
        try:
            return await run_trainer(options, [])
        finally:
            stop.set()
            await asyncio.wait_for(runners, 60)

    (step,) = asyncio.run(run())
    assert step.num_groups == 2
    dispatched = asyncio.run(read_topic(settings, TopicKey.TASKS, RolloutRequest))
    assert sorted({(r.task_id, r.input["n"]) for r in dispatched}) == [("t0", 0), ("t2", 2)]  # the failed ones
    assert len(dispatched) >= 4  # groups of two


def test_tasks_sql_without_stored_payloads_says_so(
    settings: FulmenSettings, linked_store: Store, tmp_path: Path
) -> None:
    unknown = "SELECT arrayJoin(['never-dispatched', 'nor-this'])"
    with pytest.raises(Exception, match="none of the 2 selected task id"):
        asyncio.run(run_trainer(replay_settings(settings, tmp_path, "", tasks_sql=unknown), []))


def test_warmup_sql_fine_tunes_on_the_calls_of_the_selected_stored_rollouts_once(
    settings: FulmenSettings, linked_store: Store, tmp_path: Path
) -> None:
    """``--warmup-sql``: the rewarded rollouts and the one with no reward at all are selected; the warm-up imitates
    every call of them (no reward needed) except the one of another vocabulary, and a second run reuses it."""
    from fulmen.algorithm.tiny_model import build_tiny_model
    from fulmen.warmup import MARKER, warmed_model

    fill(linked_store)
    db = linked_store.database
    sql = f"SELECT RolloutId FROM {db}.transitions WHERE Reward = 1 OR RolloutId = 'silent'"
    train = replay_settings(settings, tmp_path, "", warmup_sql=sql, warmup_steps=2, seed=1)
    model = build_tiny_model(tmp_path / "tiny")
    said: list[str] = []
    warmed = warmed_model(train.train.model_dump(), "", model, [], tmp_path / "home", said.append, settings=train)
    recorded = json.loads((warmed / MARKER).read_text())
    assert (recorded["calls"], recorded["episodes"], recorded["updates"]) == (5, 5, 2)  # 4 rewarded + silent
    assert "2 supervised steps on the 5 stored calls" in said[0] and "1 other base model" in said[0]
    assert warmed.parent.name.startswith("sql-") and (warmed / "model.safetensors").is_file()
    again = warmed_model(train.train.model_dump(), "", model, [], tmp_path / "home", settings=train)
    assert again == warmed  # the same calls, plan and model: the cached warm-up


def test_a_run_keeps_only_the_newest_checkpoints_it_is_told_to(
    settings: FulmenSettings, linked_store: Store, tmp_path: Path
) -> None:
    """``keep_checkpoints=2``: after three steps only v2 and v3 are on disk, v3 with the optimizer state."""
    from fulmen.algorithm.trainer.base import TRAINING_STATE

    fill(linked_store)
    sql = f"SELECT DISTINCT RolloutId FROM {linked_store.database}.transitions"
    done = asyncio.run(run_trainer(replay_settings(settings, tmp_path, sql, steps=3, keep_checkpoints=2), [], None))
    assert [s.step for s in done] == [1, 2, 3]
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert kept == ["v2", "v3"] and (tmp_path / "run" / "checkpoints" / "v3" / TRAINING_STATE).is_file()
