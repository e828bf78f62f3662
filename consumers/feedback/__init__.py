"""The feedback consumer: late rewards (``Feedback`` events) resolved to the call or episode they score, and stored.

``resolver`` (one query per round: response ids → the calls' spans, rollout ids → their latest attempt, trace ids →
their rollout), ``worker`` (the consume loop: looks again until the grace, waits for the other consumers, stores,
dead-letters what is never found, commits), ``app`` (its entry in ``fulmen consume``), ``settings``
(``FULMEN_FEEDBACK_*``).
"""

from fulmen.consumers.feedback.app import FeedbackSink, StoreBarrier
from fulmen.consumers.feedback.resolver import Resolved, TargetResolver
from fulmen.consumers.feedback.settings import FeedbackSection
from fulmen.consumers.feedback.worker import FEEDBACK_SCHEMA, FeedbackStats, FeedbackWorker, feedback_rows

__all__ = [
    "FEEDBACK_SCHEMA",
    "FeedbackSection",
    "FeedbackSink",
    "FeedbackStats",
    "FeedbackWorker",
    "Resolved",
    "StoreBarrier",
    "TargetResolver",
    "feedback_rows",
]
