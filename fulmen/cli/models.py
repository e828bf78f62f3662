"""``fulmen models list | promote VERSION | rollback``: which version serves, each version's score, by hand.

``list`` reads the store (``model_versions``, the held-out scores in ``train_steps``, the decisions in
``promotions``) through the read-only reader. ``promote`` and ``rollback`` publish a ``ModelPromotion`` on the
promotions topic (:mod:`fulmen.algorithm.promotion`), read first to its end: that topic, not the store, says what
serves; the gateways that follow promotions (``FULMEN_LLM_FOLLOW=promoted``) load the version in force without
failing a call.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fulmen.algorithm.promotion import MODELS_SENDER, in_force, manual, previous_promoted
from fulmen.infra.errors import ConfigurationError
from fulmen.infra.kafka.broker import kafka_broker
from fulmen.infra.kafka.clients import close_quietly, start_or_raise
from fulmen.infra.kafka.publish import EventPublisher
from fulmen.infra.kafka.read_all import read_to_end
from fulmen.infra.services import ensure_kafka
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas.events import ModelPromotion, ModelVersion, PromotionAction
from fulmen.schemas.topics import TopicKey

__all__ = ["VersionRow", "decide_by_hand", "version_rows"]


@dataclass(frozen=True)
class VersionRow:
    """One version of a model as ``fulmen models list`` shows it."""

    version: int
    run_id: str
    parent: str
    score: float | None
    decision: str
    serving: bool
    uri: str


def version_rows(reader: Any, database: str, model_name: str) -> list[VersionRow]:
    """Every stored version of ``model_name`` (and every candidate a gated run judged), oldest first."""
    versions = reader.query(f"SELECT Version, RunId, Uri, BaseModel, CreatedAt FROM {database}.model_versions "
                            "WHERE ModelName = %(name)s AND Adapter = '' ORDER BY CreatedAt", {"name": model_name},
                            final=True, read_only=True).rows  # fmt: skip
    scores = {(run, int(step)): score for run, step, score in reader.query(
        f"SELECT RunId, Step, Extra['val_accuracy'] FROM {database}.train_steps WHERE mapContains(Extra, "
        "'val_accuracy')", None, final=True, read_only=True).rows}  # fmt: skip
    decisions = reader.query(f"SELECT Version, RunId, Action, Score, Uri, BaseModel, CreatedAt FROM {database}."
                             "promotions WHERE ModelName = %(name)s AND Adapter = '' ORDER BY CreatedAt",
                             {"name": model_name}, final=True, read_only=True).rows  # fmt: skip
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for version, run, uri, base, _ in versions:
        rows[(run, int(version))] = {"uri": uri, "base": base, "decision": "-", "score": None}
    serving: tuple[str, int] | None = None
    for version, run, action, score, uri, base, _ in decisions:
        row = rows.setdefault((run, int(version)), {"uri": uri, "base": base, "decision": "-", "score": None})
        row["decision"] = {"promote": "promoted", "rollback": "rolled back to", "reject": "rejected"}[action]
        row["score"] = score if score is not None else row["score"]
        if action != PromotionAction.REJECT:
            serving = (run, int(version))
    shown = []
    for (run, version), row in rows.items():
        score = row["score"] if row["score"] is not None else scores.get((run, version))
        parent = f"v{version - 1}" if version > 1 else (row["base"] or "-")
        shown.append(VersionRow(version, run, parent if version > 0 else "-", score, row["decision"],
                                serving == (run, version), row["uri"]))  # fmt: skip
    return shown


def decide_by_hand(settings: FulmenSettings, model_name: str, action: PromotionAction, version: int | None,
                   run_id: str | None, reason: str) -> ModelPromotion:  # fmt: skip
    """Publish a promote (``version``, of run ``run_id`` when two runs have it) or a rollback (to the version that
    served before the one in force); the event, once Kafka acknowledged it."""
    ensure_kafka(settings, start=False)

    async def decide() -> ModelPromotion:
        promotions = await read_to_end(settings, TopicKey.PROMOTIONS, ModelPromotion)
        current = in_force(promotions, model_name)
        if action is PromotionAction.ROLLBACK:
            target = previous_promoted(promotions, model_name).model
        else:
            assert version is not None
            known = [p.model for p in promotions] + await read_to_end(settings, TopicKey.MODELS, ModelVersion)
            target = _the_version(known, model_name, version, run_id)
        event = manual(action, target, current, reason)
        broker = kafka_broker(settings)
        try:
            await start_or_raise(broker, settings, "fulmen models")
            await EventPublisher(broker, MODELS_SENDER).publish(TopicKey.PROMOTIONS, event)
        finally:
            await close_quietly([broker])
        return event

    return asyncio.run(decide())


def _the_version(known: list[ModelVersion], model_name: str, version: int, run_id: str | None) -> ModelVersion:
    found = {(m.run_id, m.version): m for m in known
             if m.model_name == model_name and not m.adapter and m.version == version
             and (run_id is None or m.run_id == run_id)}  # fmt: skip
    if not found:
        where = f" of run {run_id}" if run_id else ""
        raise ConfigurationError(f"no version {version}{where} of {model_name} on the models or promotions topics "
                                 "(`fulmen models list` shows the stored ones)")  # fmt: skip
    if len(found) > 1:
        runs = ", ".join(sorted(run for run, _ in found))
        raise ConfigurationError(f"version {version} of {model_name} exists in several runs ({runs}): say which "
                                 "with --run")  # fmt: skip
    return next(iter(found.values()))
