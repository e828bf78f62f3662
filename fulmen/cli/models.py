"""``fulmen models promote VERSION | rollback``: decide by hand which version serves (``fulmen models list`` reads
the store: :mod:`fulmen.versions`).

Both publish a ``ModelPromotion`` on the promotions topic (:mod:`fulmen.algorithm.promotion`), read first to its
end: that topic, not the store, says what serves; the gateways that follow promotions (``FULMEN_LLM_FOLLOW=
promoted``) load the version in force without failing a call.
"""

from __future__ import annotations

import asyncio

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

__all__ = ["decide_by_hand"]


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
