"""Publish prompt bundles and prompt promotions, acknowledged by Kafka before returning, and read them back.

The prompt search (``fulmen optimize-prompt``) and ``fulmen prompts`` publish through here; the gateway follows the
two topics with :mod:`fulmen.producers.llm_gateway.prompts_follower`. Both topics are small and compacted, so
their whole content is the state: :func:`read_prompts` reads them to their end with
:func:`fulmen.infra.kafka.read_all.read_to_end`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from aiokafka.structs import RecordMetadata

from fulmen.infra.kafka.broker import kafka_broker
from fulmen.infra.kafka.clients import close_quietly, start_or_raise
from fulmen.infra.kafka.publish import EventPublisher, Sender
from fulmen.infra.kafka.read_all import read_to_end
from fulmen.infra.settings import FulmenSettings
from fulmen.schemas.events import Event, PromotionAction
from fulmen.schemas.prompts import (
    InvalidPromptError,
    PromptBundle,
    PromptPromotion,
    in_force,
    rollback_target,
)
from fulmen.schemas.topics import TopicKey

__all__ = [
    "PROMPTS_SENDER",
    "decide_prompt",
    "publish_bundles",
    "publish_prompt_promotion",
    "read_bundles",
    "read_prompt_promotions",
]

PROMPTS_SENDER = Sender("prompts", (TopicKey.PROMPTS, TopicKey.PROMPT_PROMOTIONS))
"""``fulmen prompts``, ``fulmen optimize-prompt``."""


async def _publish(settings: FulmenSettings, key: TopicKey, events: Sequence[Event]) -> list[RecordMetadata]:
    broker = kafka_broker(settings)
    try:
        await start_or_raise(broker, settings, "prompt publisher")
        return await EventPublisher(broker, PROMPTS_SENDER).publish_many(key, events)
    finally:
        await close_quietly([broker])


async def publish_bundles(settings: FulmenSettings, bundles: Iterable[PromptBundle]) -> list[RecordMetadata]:
    """Publish the bundles on the prompts topic; returns once Kafka acknowledged every one (publishing one twice is
    harmless: same key, same content). Raises BrokerUnavailableError when the broker does not acknowledge."""
    return await _publish(settings, TopicKey.PROMPTS, list(bundles))


async def publish_prompt_promotion(settings: FulmenSettings, promotion: PromptPromotion) -> RecordMetadata:
    """Publish one promotion on the prompt promotions topic; returns once Kafka acknowledged it."""
    return (await _publish(settings, TopicKey.PROMPT_PROMOTIONS, [promotion]))[0]


async def read_bundles(settings: FulmenSettings) -> dict[str, PromptBundle]:
    """Every bundle on the prompts topic now, by id."""
    return {b.bundle_id: b for b in await read_to_end(settings, TopicKey.PROMPTS, PromptBundle)}


async def read_prompt_promotions(settings: FulmenSettings) -> list[PromptPromotion]:
    """Every promotion on the prompt promotions topic now, in topic order."""
    return await read_to_end(settings, TopicKey.PROMPT_PROMOTIONS, PromptPromotion)


async def decide_prompt(
    settings: FulmenSettings, action: PromotionAction, bundle_id: str | None, agent: str | None, reason: str
) -> PromptPromotion:
    """Promote ``bundle_id`` (it must be on the prompts topic) or roll back (to the bundle that served in the scope
    before); the event, once Kafka acknowledged it. InvalidPromptError for an unknown bundle or nothing to roll
    back."""
    promotions = await read_prompt_promotions(settings)
    current = in_force(promotions, agent)
    previous = current.bundle_id if current is not None else ""
    if action is PromotionAction.ROLLBACK:
        target = rollback_target(promotions, agent)
    else:
        if not bundle_id:
            raise InvalidPromptError("promote: name the bundle to promote (`fulmen prompts list` shows them)")
        if bundle_id not in await read_bundles(settings):
            raise InvalidPromptError(f"no bundle {bundle_id} on the prompts topic (`fulmen prompts list` shows them)")
        target = bundle_id
    event = PromptPromotion(action=action, bundle_id=target, agent=agent, previous=previous, reason=reason)
    await publish_prompt_promotion(settings, event)
    return event
