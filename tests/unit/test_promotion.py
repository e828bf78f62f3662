"""Gated promotion (``fulmen.algorithm.service.promotion``): the gate's rule, what is in force, what a rollback goes back to,
and the training loop judging every version on the held-out set and publishing each decision before its metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fulmen.algorithm.service.collector import Collector
from fulmen.algorithm.service.dispatcher import DatasetTask, Dispatcher
from fulmen.algorithm.service.groups import GroupBook
from fulmen.algorithm.service.loop import LoopPlan, TrainingLoop
from fulmen.algorithm.service.promotion import PromotionGate, Serving, in_force, manual, previous_promoted
from fulmen.algorithm.settings import TrainSection
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import ModelPromotion, ModelVersion, PromotionAction, RolloutMode, RolloutRequest
from fulmen.schemas.topics import TopicKey
from tests.fakes import FakeConsumer
from tests.unit.test_train_loop import FakeBackend, FakePublisher, reply

pytestmark = pytest.mark.continuous


def version(n: int, run: str = "r1", model: str = "fulmen") -> ModelVersion:
    return ModelVersion(model_name=model, version=n, uri=f"/ckpt/{run}/v{n}", run_id=run)


def outcomes(solved: int, n: int = 200) -> dict[str, float]:
    """Per held-out task: the first ``solved`` tasks of ``n`` solved."""
    return {f"t{i}": float(i < solved) for i in range(n)}


def test_a_candidate_is_promoted_only_when_its_paired_gain_is_above_the_margin() -> None:
    gate = PromotionGate(Serving(0, None))
    gate.know_serving(0.5, outcomes(100))  # the run's validation before step 1: the serving version's outcomes
    first = gate.decide(version(1), 0.6, outcomes(120))  # +10 points, every changed task a gain: promoted
    tie = gate.decide(version(2), 0.6, outcomes(120))  # the same tasks solved: a tie is refused
    worse = gate.decide(version(3), 0.4, outcomes(80))
    assert [e.action for e in (first, tie, worse)] == ["promote", "reject", "reject"]
    assert (first.heldout_n, first.gain, first.confidence, first.margin) == (200, 0.1, 0.95, 0.0)
    assert 0 < first.gain_low < 0.1 < first.gain_high
    assert (tie.gain, tie.gain_low, tie.gain_high) == (0.0, 0.0, 0.0) and "not above the margin 0" in tie.reason
    assert (tie.serving_version, tie.serving_score, tie.score) == (1, 0.6, 0.6)
    assert gate.promoted == [1] and gate.rejected == [2, 3] and gate.serving == Serving(1, 0.6, "r1")
    # a rejection never takes the model's key on the compacted topic; a promotion does
    assert first.topic_key == "fulmen" and tie.topic_key == "fulmen@r1/v2"


def test_the_gate_refuses_noise_and_gains_inside_the_margin() -> None:
    serving = outcomes(100)
    noisy = dict(serving) | {f"t{i}": 0.0 for i in range(10)} | {f"t{i}": 1.0 for i in range(100, 114)}  # +4 net
    gate = PromotionGate(Serving(0, 0.5))
    gate.know_serving(0.5, serving)
    noise = gate.decide(version(1), 0.52, noisy)
    assert noise.action == "reject" and noise.gain == pytest.approx(0.02) and noise.gain_low < 0 < noise.gain_high
    strict = PromotionGate(Serving(0, 0.5), margin=0.1)
    strict.know_serving(0.5, serving)
    assert strict.decide(version(1), 0.6, outcomes(120)).action == "reject"  # +10, but the interval dips under 10
    assert strict.decide(version(2), 0.8, outcomes(160)).action == "promote"
    unmeasured = PromotionGate(Serving(0, 0.5))  # no validation of the serving version: nothing to compare with
    refused = unmeasured.decide(version(1), 1.0, outcomes(200))
    assert refused.action == "reject" and refused.heldout_n == 0 and "no held-out task" in refused.reason
    looser = PromotionGate(Serving(0, 0.5), confidence=0.5)  # a narrower interval: the same noise passes
    looser.know_serving(0.5, serving)
    assert looser.decide(version(1), 0.52, noisy).action == "promote"
    for bad in ({"margin": -0.1}, {"margin": 1.0}, {"confidence": 0.4}, {"confidence": 1.0}):
        with pytest.raises(ConfigurationError):
            PromotionGate(Serving(0, None), **bad)


def test_what_is_in_force_and_what_a_rollback_goes_back_to() -> None:
    def decided(action: PromotionAction, n: int, model: str = "fulmen") -> ModelPromotion:
        return ModelPromotion(action=action, model=version(n, model=model))

    history = [
        decided(PromotionAction.PROMOTE, 1),
        decided(PromotionAction.REJECT, 2),
        decided(PromotionAction.PROMOTE, 3),
        decided(PromotionAction.PROMOTE, 9, model="other"),
    ]
    assert in_force(history, "fulmen").model.version == 3 and in_force(history, "nothing") is None
    assert previous_promoted(history, "fulmen").model.version == 1  # the rejected 2 never served
    history.append(manual(PromotionAction.ROLLBACK, version(1), in_force(history, "fulmen"), "bad answers"))
    assert in_force(history, "fulmen").model.version == 1
    assert history[-1].serving_version == 3 and history[-1].score is None
    assert previous_promoted(history, "fulmen").model.version == 3  # rolling back again goes forward to 3
    with pytest.raises(ConfigurationError, match="only one ever promoted"):
        previous_promoted(history[:1], "fulmen")
    with pytest.raises(ConfigurationError, match="nothing to roll back"):
        previous_promoted([], "fulmen")


def test_a_gated_run_judges_every_version_and_publishes_each_decision_before_its_metrics(tmp_path: Path) -> None:
    """Held-out accuracy by the version that served: 0.5 before step 1, then 0.75, 0.0, 1.0 (20 tasks)."""
    accuracy = {0: 0.5, 1: 0.75, 2: 0.0, 3: 1.0}

    def answer(request: RolloutRequest, number: int):
        if request.mode is RolloutMode.VAL:
            good = int(request.task_id[1:]) < accuracy[request.model_version] * 20
            return reply(request, number, reward=float(good))
        return reply(request, number)

    options = TrainSection(steps=3, group_size=2, groups_per_step=1, run_id="r1", promote_if_better=True)
    source = FakeConsumer()
    publisher = FakePublisher(source, answer)
    collector = Collector(source, GroupBook(timeout_s=60, policy=options.incomplete_policy), poll_timeout_ms=0)
    train = Dispatcher(publisher, [DatasetTask("t", {"n": 1})], group_size=2, max_in_flight=2)  # type: ignore[arg-type]
    val = Dispatcher(
        publisher,
        [DatasetTask(f"v{i}", {"n": i}) for i in range(20)],
        group_size=1,  # type: ignore[arg-type]
        max_in_flight=20,
        mode=RolloutMode.VAL,
        cycle=False,
    )
    gate = PromotionGate(Serving(0, None), options.promote_margin, options.promote_confidence)
    loop = TrainingLoop(
        LoopPlan(options, tmp_path, "base"),
        FakeBackend(),
        publisher,
        collector,
        train,
        val,  # type: ignore[arg-type]
        gate=gate,
    )
    steps = asyncio.run(asyncio.wait_for(loop.run(), 30))
    decisions: list[ModelPromotion] = publisher.events[TopicKey.PROMOTIONS]
    assert [(d.model.version, d.action.value, d.score) for d in decisions] == [
        (1, "promote", 0.75),
        (2, "reject", 0.0),
        (3, "promote", 1.0),
    ]
    assert decisions[0].serving_score == 0.5 and decisions[1].serving_version == 1
    assert [d.heldout_n for d in decisions] == [20, 20, 20] and decisions[2].gain == 0.25  # against version 1
    assert [(s.extra["promoted"], s.extra["serving_version"]) for s in steps] == [(1.0, 1.0), (0.0, 1.0), (1.0, 3.0)]
    assert all("val_accuracy" in s.extra for s in steps)  # every version judged, not only every val_every
