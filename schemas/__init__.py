"""Fulmen's contracts: event models, topics, span attribute names and the store's DDL.

Everyone imports this package; it imports nothing else of Fulmen's.
"""

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
