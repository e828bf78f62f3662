"""``fulmen improve`` against the real broker and store (tiny model, simulated runners for the held-out tasks):
each round trains only on the rollouts stored since the last one, every version is judged by the paired test
against what serves, and a round cut short (the command killed after a step) is finished by the next run of the
command, past the groups it already trained on: nothing trained twice, nothing skipped."""

from __future__ import annotations

import asyncio
import logging
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from fulmen.algorithm.service.dispatcher import DatasetTask
from fulmen.algorithm.service.improve import ImprovePlan, Round, RoundBook, improve, round_selection
from fulmen.algorithm.service.reporting import read_metrics
from fulmen.algorithm.service.run import run_trainer
from fulmen.algorithm.settings import TrainSettings
from fulmen.cli.main import app
from fulmen.consumers.event_sinks import TRANSITION_SCHEMA, transition_rows
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store
from fulmen.schemas import ModelPromotion, ModelVersion, RolloutMode, RolloutRequest, TopicKey, TransitionBatch
from tests.integration.test_replay import replay_settings, stored_batch
from tests.integration.test_train_loop import answer, read_topic, simulated_runners

pytestmark = [pytest.mark.integration, pytest.mark.continuous]

START = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
VAL = [DatasetTask(f"v{i}", {"question": str(i)}) for i in range(20)]


def held_out_by_version(request: RolloutRequest, rng: random.Random) -> TransitionBatch:
    """Held-out task ``v<i>`` is solved by version ``n`` when i < 4 + 8n: 4, 12, then all 20 of them."""
    batch = answer(request, rng)
    if request.mode is RolloutMode.VAL:
        reward = float(int(request.task_id[1:]) < 4 + 8 * request.model_version)
        batch = batch.model_copy(update={"episode_reward": reward})
    return batch


def store_groups(store: Store, groups: list[str], ended: datetime) -> None:
    """Groups of four answered rollouts (half rewarded), their rollouts' rows ended at ``ended``."""
    rng = random.Random(hash(tuple(groups)) % 1000)
    batches = [stored_batch(rng, f"{g}-{i}", g, float(i % 2)) for g in groups for i in range(4)]
    rows = [row for batch in batches for row in transition_rows(batch)]
    store.insert_arrow("transitions", pa.Table.from_pylist(rows, schema=TRANSITION_SCHEMA))
    values = ", ".join(
        f"('{b.rollout_id}', 1, '{b.task_id}', '{b.group_id}', 'train', 'succeeded', 3, {b.episode_reward}, "
        f"'{ended.strftime('%Y-%m-%d %H:%M:%S.%f')}')"
        for b in batches
    )
    store.command(
        f"INSERT INTO {store.database}.rollouts (RolloutId, Attempt, TaskId, GroupId, Mode, Status, StatusRank, "
        f"Reward, Timestamp) VALUES {values}"
    )


def improve_settings(settings: FulmenSettings, tmp_path: Path, store: Store) -> TrainSettings:
    sql = f"SELECT RolloutId FROM {store.database}.rollouts WHERE Reward IS NOT NULL"
    return replay_settings(settings, tmp_path, sql, run_id="improve-run", val_group_size=2, max_staleness=100)


async def rounds_with_runners(options: TrainSettings, plan: ImprovePlan, now: datetime) -> list[Round]:
    stop, runners_stop = asyncio.Event(), asyncio.Event()
    runners = asyncio.create_task(simulated_runners(options, runners_stop, respond=held_out_by_version))
    try:
        return await asyncio.wait_for(improve(options, plan, VAL, stop, clock=lambda: now), 300)
    finally:
        runners_stop.set()
        await asyncio.wait_for(runners, 60)


async def test_each_round_trains_on_what_came_since_the_last_and_promotes_only_what_beats_the_serving_version(
    settings: FulmenSettings, linked_store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    options = improve_settings(settings, tmp_path, linked_store)
    plan = ImprovePlan(every_s=0, rounds=1, settle_s=60)
    store_groups(linked_store, ["a0", "a1"], START)
    store_groups(linked_store, ["late"], START + timedelta(minutes=30) - timedelta(seconds=30))  # not settled yet
    first = await rounds_with_runners(options, plan, START + timedelta(minutes=30))
    assert [(r.number, r.groups, r.steps_from, r.steps_to) for r in first] == [(1, 2, 0, 2)]
    assert first[0].promoted == [1, 2] and first[0].serving_version == 2  # 4 -> 12 -> 20 of 20 held-out tasks
    store_groups(linked_store, ["b0", "b1", "b2"], START + timedelta(minutes=40))
    second = await rounds_with_runners(
        options, ImprovePlan(every_s=0, rounds=2, settle_s=60), START + timedelta(hours=1)
    )
    # the second round: the group that had not settled at the first, and the three stored since
    assert [(r.number, r.groups, r.steps_from, r.steps_to) for r in second] == [(2, 4, 2, 6)]
    assert second[0].promoted == [] and second[0].rejected == [3, 4, 5, 6]  # all 20 solved, as v2 did: ties
    assert second[0].serving_version == 2
    metrics = {int(r["step"]): r for r in read_metrics(options.run_dir / "metrics.jsonl")}
    assert "extra/initial_val_accuracy" in metrics[1] and "extra/initial_val_accuracy" not in metrics[3]  # v2's known
    decisions = await read_topic(settings, TopicKey.PROMOTIONS, ModelPromotion)
    assert [(d.model.version, d.action.value) for d in decisions] == [
        (1, "promote"),
        (2, "promote"),
        (3, "reject"),
        (4, "reject"),
        (5, "reject"),
        (6, "reject"),
    ]
    assert decisions[0].serving_version == 0 and decisions[0].gain == 0.4 and decisions[0].heldout_n == 20
    assert (decisions[3].gain, decisions[3].gain_low, decisions[3].gain_high) == (0.0, 0.0, 0.0)
    book = RoundBook(options.run_dir)
    assert [r.done for r in book.rounds] == [True, True] and book.rounds[1].since == book.rounds[0].until
    nothing = await rounds_with_runners(
        options, ImprovePlan(every_s=0, rounds=3, settle_s=60), START + timedelta(hours=2)
    )
    assert [(r.number, r.groups, r.steps_from, r.steps_to) for r in nothing] == [(3, 0, 6, 6)]  # nothing new
    store_groups(linked_store, ["d0"], START + timedelta(hours=2, minutes=30))
    with caplog.at_level(logging.INFO, logger="fulmen.algorithm.service.run"):
        fourth = await rounds_with_runners(
            options, ImprovePlan(every_s=0, rounds=4, settle_s=60), START + timedelta(hours=3)
        )
    assert [(r.number, r.groups, r.steps_from, r.steps_to) for r in fourth] == [(4, 1, 6, 7)]
    # v3-v6 were refused: the round trains from v2, the version that serves, not from v6 (numbered after it)
    assert f"goes on from {options.run_dir / 'checkpoints' / 'v2'} (not its latest version v6)" in caplog.text


async def test_a_round_cut_short_is_finished_by_the_next_run_past_the_groups_already_trained(
    settings: FulmenSettings, linked_store: Store, tmp_path: Path
) -> None:
    options = improve_settings(settings, tmp_path, linked_store)
    store_groups(linked_store, ["c0", "c1", "c2"], START)
    now = START + timedelta(minutes=10)
    book = RoundBook(options.run_dir)  # what the killed command had written: its round, planned to step 3
    cut = book.next_round(ImprovePlan(settle_s=0), now, steps=0)
    cut.steps_to = 3
    book.save()
    killed = options.model_copy(deep=True)  # ... and what it had trained when it was killed: step 1
    killed.train.replay_sql = round_selection(options.train.replay_sql, linked_store.database, cut.since, cut.until)
    killed.train.steps, killed.train.promote_if_better = 1, True
    stop = asyncio.Event()
    runners = asyncio.create_task(simulated_runners(options, stop, respond=held_out_by_version))
    try:
        await asyncio.wait_for(run_trainer(killed, [], VAL), 300)
    finally:
        stop.set()
        await asyncio.wait_for(runners, 60)
    finished = await rounds_with_runners(options, ImprovePlan(every_s=0, rounds=1, settle_s=0), now)
    assert [(r.number, r.steps_from, r.steps_to, r.done) for r in finished] == [(1, 0, 3, True)]
    assert finished[0].promoted == [1, 2] and finished[0].rejected == [3]  # step 1's decided before the cut
    versions = await read_topic(settings, TopicKey.MODELS, ModelVersion)
    assert sorted(v.version for v in versions) == [1, 2, 3]  # no version published twice
    position = (options.run_dir / "replay" / "v3.json").read_text()
    assert '"next": 0' in position and '"passes": 1' in position  # c0, c1, c2 once each: none twice, none skipped


def test_the_command_says_what_is_missing_and_reads_durations() -> None:
    runner = CliRunner()
    missing = runner.invoke(app, ["improve", "--val", "val.jsonl", "--model", "tiny"])
    assert missing.exit_code == 1 and "--replay" in missing.output
    bad = runner.invoke(app, ["improve", "--val", "val.jsonl", "--every", "soon", "--replay", "SELECT 1"])
    assert bad.exit_code == 1 and "--every 'soon': give a duration such as 90s, 10m or 1h" in bad.output
    where = runner.invoke(app, ["improve", "--val", "val.jsonl", "--train-from", "best", "--replay", "SELECT 1"])
    assert where.exit_code == 1 and "--train-from 'best': give serving or latest" in where.output
