"""Gated promotion: never ship a worse model.

A run with ``promote_if_better`` (``fulmen train --promote-if-better``) validates every version it trains on the
held-out set and decides, with :class:`PromotionGate`, whether it serves: a candidate whose held-out accuracy is at
least the serving version's minus ``promote_tolerance`` is promoted (it serves from now on, and its score is the
bar for the next one), any other is rejected. Each decision is a :class:`ModelPromotion` on the compacted
promotions topic (``promote`` keyed by the model, so compaction keeps the version in force; ``reject`` keyed by the
candidate). Gateways started with ``FULMEN_LLM_FOLLOW=promoted`` serve what is promoted; the training gateway
(``newest``, the default) keeps serving each new version to the training rollouts.

What serves at the start (:func:`in_force`): the latest ``promote`` or ``rollback`` of the model on the topic. Its
score is the one it was promoted with; a version promoted by hand (``fulmen models promote``) or a run with nothing
on the topic (the base model serves) has no score yet, and the run's validation before step 1 stands for it (the
weights the run starts from are the serving ones, unless the run resumes a checkpoint).

``fulmen models promote VERSION`` and ``fulmen models rollback`` (:func:`manual`) publish the same events by hand:
a rollback is a ``rollback`` naming an earlier promoted version, and the gateways that follow promotions load it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from fulmen.infra.kafka.publish import Sender
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import ModelPromotion, ModelVersion, PromotionAction
from fulmen.schemas.topics import TopicKey

__all__ = ["MODELS_SENDER", "PromotionGate", "Serving", "in_force", "manual", "previous_promoted"]

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

    def __init__(self, serving: Serving, tolerance: float) -> None:
        if tolerance < 0:
            raise ConfigurationError("FULMEN_TRAIN_PROMOTE_TOLERANCE must be 0 or more")
        self.serving = serving
        self.tolerance = tolerance
        self.promoted: list[int] = []
        self.rejected: list[int] = []

    def know_score(self, score: float) -> None:
        """The serving version's score when it had none (the run's validation before step 1)."""
        if self.serving.score is None:
            self.serving = Serving(self.serving.version, score, self.serving.run_id)

    def decide(self, candidate: ModelVersion, score: float) -> ModelPromotion:
        """Promote ``candidate`` if ``score`` is at least the serving score minus the tolerance, else reject it;
        the event to publish. A promoted candidate is the serving version from now on."""
        bar = self.serving.score
        passed = bar is None or score >= bar - self.tolerance
        action = PromotionAction.PROMOTE if passed else PromotionAction.REJECT
        shown = "-" if bar is None else f"{bar:.4f}"
        reason = (
            f"held-out accuracy {score:.4f} {'>=' if passed else '<'} {shown} (version {self.serving.version}) "
            f"minus tolerance {self.tolerance:g}"
        )
        event = ModelPromotion(
            action=action,
            model=candidate,
            score=score,
            serving_version=self.serving.version,
            serving_score=bar,
            reason=reason,
        )
        if passed:
            self.promoted.append(candidate.version)
            self.serving = Serving(candidate.version, score, candidate.run_id)
        else:
            self.rejected.append(candidate.version)
        log.info("model version %d %s: %s", candidate.version, "promoted" if passed else "rejected", reason)
        return event
