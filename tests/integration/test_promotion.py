"""Gated promotion against the real broker and store: a gateway that follows promotions serves the version in force
(a rollback goes back, a rejection is ignored), and ``fulmen models promote | rollback | list`` decide by hand and
show what serves, each version's score and decision."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from fulmen.consumers.event_sinks import EVENT_SINKS
from fulmen.infra.settings import FulmenSettings
from fulmen.infra.store import Store
from fulmen.producers.llm_gateway.models_follower import PromotionsFollower
from fulmen.schemas import ModelPromotion, ModelVersion, PromotionAction, TopicKey, TrainStep
from fulmen.testing.publishing import event_publisher
from tests.integration.test_models_follower import Backend, until
from tests.integration.test_train_loop import FULMEN, read_topic

pytestmark = [pytest.mark.integration, pytest.mark.continuous]


def version(number: int, run: str = "run-a") -> ModelVersion:
    return ModelVersion(model_name="m", version=number, uri=f"/ckpt/{run}/v{number}", run_id=run)


def decided(action: PromotionAction, number: int, run: str = "run-a", score: float | None = None) -> ModelPromotion:
    return ModelPromotion(action=action, model=version(number, run), score=score)


async def test_a_gateway_following_promotions_serves_the_version_in_force(settings: FulmenSettings) -> None:
    async with event_publisher(settings) as publisher:
        await publisher.publish_many(
            TopicKey.PROMOTIONS,
            [
                decided(PromotionAction.PROMOTE, 1),
                decided(PromotionAction.PROMOTE, 2),
                decided(PromotionAction.REJECT, 3),
            ],
        )
        await publisher.publish(TopicKey.MODELS, version(3))  # the newest version: not what this gateway serves
        backend, stop = Backend(), asyncio.Event()
        follower = PromotionsFollower(settings, "m", lambda adapter: backend.version, backend.load)
        await asyncio.wait_for(follower.catch_up(), 60)
        assert backend.loaded == [2]  # the latest promotion; the rejected 3 never
        following = asyncio.create_task(follower.run(stop))
        await publisher.publish(TopicKey.PROMOTIONS, decided(PromotionAction.ROLLBACK, 1))
        await until(lambda: backend.loaded == [2, 1])  # back to an older version
        await publisher.publish(TopicKey.PROMOTIONS, decided(PromotionAction.PROMOTE, 1, run="run-b"))
        await until(lambda: backend.loaded == [2, 1, 1])  # another run's version 1 is another model
        stop.set()
        await asyncio.wait_for(following, 30)


def cli(settings: FulmenSettings, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {
        "FULMEN_KAFKA_BOOTSTRAP": settings.bootstrap,
        "FULMEN_KAFKA_TOPIC_PREFIX": settings.kafka.topic_prefix,
        "FULMEN_HOME": str(settings.home),
        "FULMEN_CLICKHOUSE_PATH": str(settings.clickhouse.path),
        "FULMEN_CLICKHOUSE_DATABASE": settings.clickhouse.database,
        "FULMEN_CLICKHOUSE_READ_PORT": "0",
    }
    return subprocess.run([*FULMEN, *args], env=env, capture_output=True, text=True, timeout=180)


def test_models_promote_rollback_and_list(settings: FulmenSettings, tmp_path: Path) -> None:
    async def publish() -> None:
        async with event_publisher(settings) as publisher:
            await publisher.publish_many(TopicKey.MODELS, [version(1), version(2)])
            await publisher.publish_many(
                TopicKey.PROMOTIONS,
                [
                    decided(PromotionAction.PROMOTE, 1, score=0.5).model_copy(
                        update={
                            "heldout_n": 200,
                            "gain": 0.1,
                            "gain_low": 0.058,
                            "gain_high": 0.142,
                            "confidence": 0.95,
                        }
                    ),
                    decided(PromotionAction.REJECT, 2, score=0.25),
                ],
            )

    asyncio.run(publish())
    done = cli(settings, "models", "promote", "2", "--model", "m", "--reason", "reviewed")
    assert done.returncode == 0 and "promoted m version 2 (run run-a)" in done.stdout, done.stdout + done.stderr
    done = cli(settings, "models", "rollback", "--model", "m")
    assert done.returncode == 0 and "rolled m back to version 1" in done.stdout, done.stdout + done.stderr
    missing = cli(settings, "models", "promote", "7", "--model", "m")
    assert missing.returncode != 0 and "no version 7 of m" in missing.stdout + missing.stderr
    decisions = asyncio.run(read_topic(settings, TopicKey.PROMOTIONS, ModelPromotion))
    assert [(d.action.value, d.model.version) for d in decisions] == [
        ("promote", 1),
        ("reject", 2),
        ("promote", 2),
        ("rollback", 1),
    ]
    assert decisions[2].reason == "reviewed" and decisions[3].serving_version == 2

    # what `fulmen consume` stores of those topics, then the list a person reads
    store = Store.open(settings)
    store.migrate()
    for name, events in (
        ("model_versions", [version(1), version(2)]),
        ("promotions", decisions),
        (
            "train_steps",
            [
                TrainStep(
                    run_id="run-a",
                    step=1,
                    model_version=1,
                    num_transitions=1,
                    num_groups=1,
                    reward_mean=0.5,
                    reward_std=0.0,
                    loss=0.1,
                    extra={"val_accuracy": 0.5},
                )
            ],
        ),
    ):
        sink = EVENT_SINKS[name]
        store.insert_batch(sink.table, sink.to_batch([sink.rows(e) for e in events]))
    from fulmen.versions import version_rows

    rows = {row.version: row for row in version_rows(store, "m", store.database)}
    assert rows[1].serving and not rows[2].serving  # rolled back to 1
    assert (rows[1].decision, rows[1].score, rows[1].parent) == ("rolled back to", 0.5, "-")
    assert (rows[2].decision, rows[2].parent, rows[2].uri) == ("promoted", "v1", "/ckpt/run-a/v2")
    assert rows[1].test == "+10.0 [+5.8, +14.2] n=200 (95%)" and rows[2].test == "-"  # by hand: no test
    store.command(f"DROP DATABASE IF EXISTS {store.database}")
