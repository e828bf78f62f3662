"""``fulmen feedback``: a reward for an LLM call, a rollout or a trace, sent any time after it, straight to Kafka.

The same request as the LLM gateway's ``POST /v1/feedback`` (:mod:`fulmen.producers.feedback`), published with
``source`` ``cli``; the feedback consumer then finds the target in the store (or dead-letters it, saying why).
"""

from __future__ import annotations

import asyncio
import re

from fulmen.infra.kafka.broker import kafka_broker
from fulmen.infra.kafka.clients import close_quietly, start_or_raise
from fulmen.infra.kafka.publish import EventPublisher
from fulmen.infra.services import ensure_kafka
from fulmen.infra.settings import FulmenSettings
from fulmen.producers.feedback import SENDER, FeedbackRequestError, feedback_from, publish
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import Feedback

__all__ = ["send_feedback"]


def send_feedback(settings: FulmenSettings, request: dict[str, object]) -> Feedback:
    """Check ``request`` (the fields of ``POST /v1/feedback``), publish it, return the Feedback once acknowledged.

    Kafka must run (a local one is not started: a feedback is for a deployment that runs); its topics are created
    where missing. Raises :class:`ConfigurationError` for a request that is not one (``--trace-id`` and
    ``--rollout-id`` together, a value that is not finite...), and
    :class:`~fulmen.schemas.errors.BrokerUnavailableError` when Kafka does not answer or take it.
    """
    try:
        feedback = feedback_from(request, source="cli")
    except FeedbackRequestError as exc:
        raise ConfigurationError(_as_options(exc)) from None
    ensure_kafka(settings, start=False)

    async def send() -> None:
        broker = kafka_broker(settings)
        try:
            await start_or_raise(broker, settings, "feedback")
            await publish(EventPublisher(broker, SENDER), feedback)
        finally:
            await close_quietly([broker])

    asyncio.run(send())
    return feedback


def _as_options(error: FeedbackRequestError) -> str:
    """The error with the request's field names as the command's options (``trace_id`` -> ``--trace-id``)."""
    message = re.sub(r"\b(response|rollout|trace)_id\b", r"--\1-id", error.message)
    if error.param in ("value", "name", "comment") and message.startswith(error.param):
        message = f"--{message}"
    return message
