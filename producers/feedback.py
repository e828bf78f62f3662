"""Late feedback as it comes in: a request (the LLM gateway's ``POST /v1/feedback``, ``fulmen feedback``) checked and
turned into a :class:`~fulmen.schemas.events.Feedback` for the feedback topic.

A request names exactly one target: ``response_id`` (an LLM call: the ``id`` the gateway answered with),
``rollout_id`` or ``trace_id`` (32 lowercase hex digits); a ``value`` (a finite number); optionally a ``name``
(default ``reward``) and a ``comment``. Whether the target exists is not known here: the feedback consumer looks it
up in the store, and dead-letters what it never finds (:mod:`fulmen.consumers.feedback`).
"""

from __future__ import annotations

import math
from typing import Any

from fulmen.infra.kafka.publish import EventPublisher, Sender
from fulmen.schemas.codec import decode_obj
from fulmen.schemas.errors import PoisonInputError
from fulmen.schemas.events import Feedback, FeedbackTarget
from fulmen.schemas.topics import TopicKey

__all__ = ["ID_FIELDS", "SENDER", "FeedbackRequestError", "feedback_from", "publish"]

SENDER = Sender("feedback", (TopicKey.FEEDBACK,))  # `fulmen feedback`; the gateway publishes on its own producer

ID_FIELDS = {
    "response_id": FeedbackTarget.RESPONSE,
    "rollout_id": FeedbackTarget.ROLLOUT,
    "trace_id": FeedbackTarget.TRACE,
}
"""The request field that names each kind of target."""

_FIELDS = (*ID_FIELDS, "name", "value", "comment")


class FeedbackRequestError(ValueError):
    """A request that cannot become a Feedback; ``param`` names the field at fault (None: the request as a whole)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def feedback_from(request: Any, source: str) -> Feedback:
    """The Feedback a request asks for (a dict of the fields in the module docstring; None values count as absent).

    Raises :class:`FeedbackRequestError` saying what is wrong: not an object, an unknown field, not exactly one id,
    a value that is not a finite number, or what the contract refuses (a bad name, a trace id that is not hex...).
    """
    if not isinstance(request, dict):
        raise FeedbackRequestError("the body must be a JSON object")
    unknown = sorted(str(key)[:64] for key in request if key not in _FIELDS)
    if unknown:
        raise FeedbackRequestError(f"unknown field(s) {', '.join(unknown)}; valid: {', '.join(_FIELDS)}", unknown[0])
    given = {key: value for key, value in request.items() if value is not None}
    named = [key for key in ID_FIELDS if key in given]
    if len(named) != 1:
        what = "none" if not named else " and ".join(named)
        raise FeedbackRequestError(
            f"give exactly one of response_id, rollout_id or trace_id (got {what})",
            named[1] if len(named) > 1 else None,
        )
    id_field = named[0]
    if not isinstance(given[id_field], str):
        raise FeedbackRequestError(f"{id_field} must be a string", id_field)
    if "value" not in given:
        raise FeedbackRequestError("value is missing: the score, a number", "value")
    value = given["value"]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FeedbackRequestError(f"value must be a number, not {type(value).__name__}", "value")
    try:
        value = float(value)
    except OverflowError:  # an integer beyond float's range
        value = math.inf
    if not math.isfinite(value):
        raise FeedbackRequestError("value must be a finite number", "value")
    for text in ("name", "comment"):
        if text in given and not isinstance(given[text], str):
            raise FeedbackRequestError(f"{text} must be a string", text)
    fields = {"target": ID_FIELDS[id_field], "target_id": given[id_field], "value": value, "source": source}
    fields |= {key: given[key] for key in ("name", "comment") if key in given}
    try:
        return decode_obj(Feedback, fields)
    except PoisonInputError as exc:  # the contract's own checks: the name's characters, a trace id's digits...
        field = getattr(exc, "field", None)
        message = exc.message.removeprefix("Feedback.").removeprefix("Feedback: ").replace("Value error, ", "")
        if field is None:  # the whole object's check, whose input (the fields) says nothing more
            message = message.split(" (got {", 1)[0]
        param = id_field if field in (None, "target_id") else field
        raise FeedbackRequestError(message.replace("target_id", id_field), param) from None


async def publish(publisher: EventPublisher, feedback: Feedback) -> None:
    """Publish one feedback, keyed by its target id; returns once the broker acknowledged it."""
    await publisher.publish(TopicKey.FEEDBACK, feedback)
