"""The calc reward: 1.0 when the last number of the final answer equals the answer, else 0.0."""

from __future__ import annotations

import re

__all__ = ["last_number", "numbers", "reward"]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
TOLERANCE = 1e-6


def numbers(text: str) -> list[float]:
    """Every number written in ``text``, in order (``1,234`` and ``12.0`` read as numbers)."""
    found = []
    for match in _NUMBER.findall(text or ""):
        try:
            found.append(float(match.replace(",", "")))
        except ValueError:  # "1,2,3," style runs that are not one number
            continue
    return found


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (``1,234`` and ``12.0`` read as numbers), or None."""
    found = _NUMBER.findall(text or "")
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def reward(answer_text: str, answer: float) -> float:
    value = last_number(answer_text)
    return 1.0 if value is not None and abs(value - float(answer)) <= TOLERANCE else 0.0
