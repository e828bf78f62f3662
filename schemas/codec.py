"""Encode events to Kafka record values and decode them back, with errors that name the field.

Values are UTF-8 JSON (``model_dump_json``). Decoding never raises anything but :class:`DecodeError`, whose
message reads like ``RolloutEvent.attempt: Input should be greater than or equal to 1 (got 0)`` and which
carries the record's topic, partition and offset when the caller passes them.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import ValidationError

from fulmen.schemas.errors import DecodeError
from fulmen.schemas.events import Event

__all__ = ["decode", "decode_obj", "encode", "encode_key"]

E = TypeVar("E", bound=Event)

_MAX_SHOWN_INPUT = 80


def encode(event: Event) -> bytes:
    """The record value of ``event``."""
    return event.model_dump_json().encode()


def encode_key(key: str | None) -> bytes | None:
    """The record key for a string key (None stays None: round-robin partitioning)."""
    return None if key is None else key.encode()


def decode(model: type[E], data: bytes | str | None, **where: Any) -> E:
    """Decode a record value into ``model``; raise :class:`DecodeError` naming the offending field.

    ``where`` may carry ``topic``, ``partition`` and ``offset`` so the error points at the record.
    """
    if data is None:
        raise DecodeError(f"{model.__name__}: the record has no value (a tombstone?)", **where)
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        raise _decode_error(model, exc, data, where) from None


def decode_obj(model: type[E], obj: Any, **where: Any) -> E:
    """Like :func:`decode`, for an already parsed object (a line of a JSONL file, say)."""
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise _decode_error(model, exc, obj, where) from None


def _decode_error(model: type[Event], exc: ValidationError, data: Any, where: dict[str, Any]) -> DecodeError:
    version_error = _schema_version_error(model, data)
    if version_error:
        return DecodeError(version_error, field="schema_version", **where)
    first = exc.errors(include_url=False)[0]
    field = ".".join(str(part) for part in first["loc"]) or None
    message = first["msg"]
    if first["type"] not in ("json_invalid", "missing") and "input" in first:
        shown = repr(first["input"])
        if len(shown) > _MAX_SHOWN_INPUT:
            shown = shown[:_MAX_SHOWN_INPUT] + "..."
        message = f"{message} (got {shown})"
    prefix = f"{model.__name__}.{field}" if field else model.__name__
    more = exc.error_count() - 1
    suffix = f"; and {more} more error{'s' if more > 1 else ''}" if more else ""
    return DecodeError(f"{prefix}: {message}{suffix}", field=field, **where)


def _schema_version_error(model: type[Event], data: Any) -> str | None:
    """A clear message when the record comes from a newer (or older) contract than this reader knows."""
    if isinstance(data, bytes | str):
        try:
            data = json.loads(data)
        except ValueError:
            return None
    if not isinstance(data, dict) or "schema_version" not in data:
        return None
    known = model.model_fields["schema_version"].default
    got = data["schema_version"]
    if got == known:
        return None
    return (
        f"{model.__name__}.schema_version: this reader knows version {known}, the record has {got!r}; "
        "run the same Fulmen version on both sides"
    )
