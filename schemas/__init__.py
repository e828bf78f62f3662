"""Fulmen's contracts: event models, topics, span attribute names and the store's DDL.

Everyone imports this package; it imports nothing else of Fulmen's. Its names are imported from their modules on
first use, so ``fulmen.schemas.errors`` (Fulmen's exceptions, which need nothing installed) loads alone: the
trainer imports it on a machine with torch and no pydantic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fulmen.schemas.lazy import lazy_exports

if TYPE_CHECKING:
    from fulmen.schemas.codec import decode, decode_obj, encode, encode_key
    from fulmen.schemas.errors import (
        BrokerUnavailableError,
        ConfigurationError,
        DecodeError,
        FulmenError,
        PoisonInputError,
        RetryableError,
    )
    from fulmen.schemas.events import (
        TERMINAL_STATUSES,
        DeadLetterHeaders,
        Event,
        Feedback,
        FeedbackTarget,
        ModelPromotion,
        ModelVersion,
        PromotionAction,
        RolloutEvent,
        RolloutMode,
        RolloutRequest,
        RolloutStatus,
        TrainStep,
        Transition,
        TransitionBatch,
        new_id,
        utc_now,
    )
    from fulmen.schemas.topics import TOPICS, Topic, TopicKey, topic, topic_name

_MODULES = {
    "decode": "codec",
    "decode_obj": "codec",
    "encode": "codec",
    "encode_key": "codec",
    "BrokerUnavailableError": "errors",
    "ConfigurationError": "errors",
    "DecodeError": "errors",
    "FulmenError": "errors",
    "PoisonInputError": "errors",
    "RetryableError": "errors",
    "TERMINAL_STATUSES": "events",
    "DeadLetterHeaders": "events",
    "Event": "events",
    "Feedback": "events",
    "FeedbackTarget": "events",
    "ModelPromotion": "events",
    "ModelVersion": "events",
    "PromotionAction": "events",
    "RolloutEvent": "events",
    "RolloutMode": "events",
    "RolloutRequest": "events",
    "RolloutStatus": "events",
    "TrainStep": "events",
    "Transition": "events",
    "TransitionBatch": "events",
    "new_id": "events",
    "utc_now": "events",
    "TOPICS": "topics",
    "Topic": "topics",
    "TopicKey": "topics",
    "topic": "topics",
    "topic_name": "topics",
}

__all__ = [
    "TERMINAL_STATUSES",
    "TOPICS",
    "BrokerUnavailableError",
    "ConfigurationError",
    "DeadLetterHeaders",
    "DecodeError",
    "Event",
    "Feedback",
    "FeedbackTarget",
    "FulmenError",
    "ModelPromotion",
    "ModelVersion",
    "PoisonInputError",
    "PromotionAction",
    "RetryableError",
    "RolloutEvent",
    "RolloutMode",
    "RolloutRequest",
    "RolloutStatus",
    "Topic",
    "TopicKey",
    "TrainStep",
    "Transition",
    "TransitionBatch",
    "decode",
    "decode_obj",
    "encode",
    "encode_key",
    "new_id",
    "topic",
    "topic_name",
    "utc_now",
]

__getattr__, __dir__ = lazy_exports(globals(), {name: f"fulmen.schemas.{module}" for name, module in _MODULES.items()})
