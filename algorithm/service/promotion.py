"""Gated promotion: never ship a worse model, nor one that only looks better by chance.

A run with ``promote_if_better`` (``fulmen train --promote-if-better``) validates every version it trains on the
held-out set and decides, with :class:`PromotionGate`, whether it serves. The test is paired: per held-out task, the
candidate's outcome minus the serving version's on the same task (:func:`fulmen.infra.stats.paired_gain`); the candidate
is promoted only when the whole interval of the mean difference, at ``promote_confidence`` (95% by default), lies
above ``promote_margin`` (0 by default). A tie, or a gain within the noise of which tasks were drawn, is refused.
The serving version's outcomes come with its promotion (each ``promote`` carries the candidate's per-task
outcomes), or, when it has none for these tasks (nothing promoted yet, a promotion by hand, another validation
set), from the run's validation before step 1 (the weights the run starts from); a promoted candidate's outcomes
become the bar for the next.
Each decision is a :class:`ModelPromotion` on the compacted promotions topic (``promote`` keyed by the model, so
compaction keeps the version in force; ``reject`` keyed by the candidate), with the test's figures: how many tasks,
the gain, its interval, the confidence and the margin. Gateways started with ``FULMEN_LLM_FOLLOW=promoted`` serve
what is promoted; the training gateway (``newest``, the default) keeps serving each new version to the training
rollouts.

What serves at the start (:func:`in_force`): the latest ``promote`` or ``rollback`` of the model on the topic; with
none, the weights the run started from, whose outcomes the run keeps in ``<run_dir>/serving.json``
(:func:`save_baseline`) so that a resumed run (or the next round of ``fulmen improve``), which starts from its
latest candidate, still compares with them.

``fulmen models promote VERSION`` and ``fulmen models rollback`` (:func:`manual`) publish the same events by hand:
a rollback is a ``rollback`` naming an earlier promoted version, and the gateways that follow promotions load it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fulmen.infra.kafka.publish import Sender
from fulmen.infra.stats import paired_gain
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import ModelPromotion, ModelVersion, PromotionAction
from fulmen.schemas.topics import TopicKey

__all__ = [
    "MODELS_SENDER",
    "PromotionGate",
    "Serving",
    "in_force",
    "load_baseline",
    "manual",
    "previous_promoted",
    "save_baseline",
]

log = logging.getLogger(__name__)

MODELS_SENDER = Sender("models", (TopicKey.PROMOTIONS,))
"""``fulmen models promote`` and ``rollback``."""

SERVING_ACTIONS = (PromotionAction.PROMOTE, PromotionAction.ROLLBACK)


@dataclass(frozen=True)
class Serving:
    """The version that serves now and its held-out score (None: not known yet)."""

    version: int
    score: float | None
    run_id: str = ""


def in_force(promotions: Sequence[ModelPromotion], model_name: str, adapter: str = "") -> ModelPromotion | None:
    """The latest promote or rollback of the model (of an agent's adapter) among ``promotions`` (topic order)."""
    found = None
    for event in promotions:
        if event.model.model_name == model_name and event.model.adapter == adapter and event.action in SERVING_ACTIONS:
            found = event
    return found


def previous_promoted(promotions: Sequence[ModelPromotion], model_name: str, adapter: str = "") -> ModelPromotion:
    """What a rollback goes back to: the version that served before the one in force (the promote or rollback
    before the latest that names another version). ConfigurationError when there is none."""
    history = [
        e
        for e in promotions
        if e.model.model_name == model_name and e.model.adapter == adapter and e.action in SERVING_ACTIONS
    ]
    if not history:
        raise ConfigurationError(f"nothing of {model_name} was ever promoted: there is nothing to roll back")
    current = history[-1].model
    for event in reversed(history[:-1]):
        if (event.model.version, event.model.run_id) != (current.version, current.run_id):
            return event
    raise ConfigurationError(
        f"{model_name} version {current.version} is the only one ever promoted: there is no "
        "earlier version to roll back to (promote one by its number instead)"
    )


def manual(action: PromotionAction, model: ModelVersion, serving: ModelPromotion | None, reason: str) -> ModelPromotion:
    """A promotion decided by hand (``fulmen models``): it carries no score."""
    return ModelPromotion(
        action=action,
        model=model,
        serving_version=serving.model.version if serving else None,
        serving_score=serving.score if serving else None,
        reason=reason,
    )


class PromotionGate:
    """Decides, version after version, which of a run's candidates serve (module docstring)."""

    def __init__(
        self,
        serving: Serving,
        margin: float = 0.0,
        confidence: float = 0.95,
        outcomes: Mapping[str, float] | None = None,
    ) -> None:
        if not 0 <= margin < 1:
            raise ConfigurationError("FULMEN_TRAIN_PROMOTE_MARGIN must be at least 0 and below 1")
        if not 0.5 <= confidence < 1:
            raise ConfigurationError("FULMEN_TRAIN_PROMOTE_CONFIDENCE must be at least 0.5 and below 1")
        self.serving = serving
        self.margin = margin
        self.confidence = confidence
        self.outcomes = dict(outcomes or {})  # the serving version's, per held-out task (its promotion's, when known)
        self.promoted: list[int] = []
        self.rejected: list[int] = []

    def know_serving(self, score: float, outcomes: Mapping[str, float]) -> None:
        """The run's validation before step 1 (the weights it starts from): the serving version's held-out outcomes
        unless its promotion already gave them for every one of these tasks (a resumed run may start from a
        candidate that was rejected), and its score when it had none."""
        if not outcomes.keys() <= self.outcomes.keys():
            self.outcomes = dict(outcomes)
        if self.serving.score is None:
            self.serving = Serving(self.serving.version, score, self.serving.run_id)

    def knows(self, tasks: Iterable[str]) -> bool:
        """Whether the serving version's outcomes cover every one of ``tasks`` (a gated run that resumes, or the next
        round of ``fulmen improve``, then needs no validation before its first step)."""
        return bool(self.outcomes) and set(tasks) <= self.outcomes.keys()

    def decide(self, candidate: ModelVersion, score: float, outcomes: Mapping[str, float]) -> ModelPromotion:
        """Promote ``candidate`` when its paired gain over the serving version (per held-out task, ``outcomes``)
        is above the margin at the gate's confidence, else reject it; the event to publish. A promoted candidate
        is the serving version from now on."""
        test = paired_gain(outcomes, self.outcomes, self.confidence)
        passed = test.above(self.margin)
        if test.n == 0:
            reason = "no held-out task validated on both versions: nothing shows it is better"
        else:
            verdict = "above" if passed else "not above"
            reason = f"{test.describe()}: {verdict} the margin {100 * self.margin:g} points"
        event = ModelPromotion(
            action=PromotionAction.PROMOTE if passed else PromotionAction.REJECT,
            model=candidate,
            score=score,
            serving_version=self.serving.version,
            serving_score=self.serving.score,
            reason=f"{reason} (against version {self.serving.version})",
            heldout_n=test.n,
            gain=test.gain,
            gain_low=test.low,
            gain_high=test.high,
            confidence=self.confidence,
            margin=self.margin,
            outcomes=dict(outcomes),
        )
        if passed:
            self.promoted.append(candidate.version)
            self.serving = Serving(candidate.version, score, candidate.run_id)
            self.outcomes = dict(outcomes)
        else:
            self.rejected.append(candidate.version)
        log.info("model version %d %s: %s", candidate.version, "promoted" if passed else "rejected", event.reason)
        return event


BASELINE = "serving.json"


def save_baseline(run_dir: Path, gate: PromotionGate) -> None:
    """What serves as the run measured it before step 1: its version, score and per-task outcomes."""
    path = run_dir / BASELINE
    staging = path.with_suffix(".json.tmp")
    serving = {"version": gate.serving.version, "score": gate.serving.score, "run_id": gate.serving.run_id}
    staging.write_text(json.dumps({"serving": serving, "outcomes": gate.outcomes}))
    staging.replace(path)


def load_baseline(run_dir: Path) -> tuple[Serving, dict[str, float]] | None:
    """:func:`save_baseline`'s record (None: the run never measured it)."""
    path = run_dir / BASELINE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return Serving(**data["serving"]), {str(k): float(v) for k, v in data["outcomes"].items()}
