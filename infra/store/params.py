"""Query parameters: long arrays of strings written as ClickHouse literal text in one pass.

clickhouse-connect writes a parameter's literal text character by character in Python; for the ids of tens of
thousands of rollouts (the transitions consumer's late-span check binds every rollout of its window, a megabyte of
text) that is a tenth of a second of CPU a query. :func:`bind_fast` writes an array of strings, or of (string,
integer) tuples, with ``str.translate`` instead and hands it over as an object whose ``str()`` is that text (what
clickhouse-connect binds for a type it does not know). The text is the library's own for the same value, escape
for escape; anything else is left to the library.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["bind_fast"]

_SHORT = 64  # arrays shorter than this are left to the library: nothing to gain

# The characters clickhouse-connect escapes in a string literal, each with a backslash before it.
_SPECIAL = ("\\", "'", "`", "\t", "\n")
_ESCAPES = str.maketrans({c: "\\" + c for c in _SPECIAL})


class _Literal:
    """A parameter value already written as ClickHouse literal text."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


def bind_fast(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """``parameters`` with each long array of strings (or of (string, int) tuples) as its literal text."""
    return {name: _array_literal(value) or value for name, value in parameters.items()}


def _array_literal(value: Any) -> _Literal | None:
    if not isinstance(value, list) or len(value) < _SHORT:
        return None
    if all(type(item) is str for item in value):
        text = "".join(value)
        if not any(special in text for special in _SPECIAL):  # the usual case: ids with nothing to escape
            return _Literal("['" + "', '".join(value) + "']")
        return _Literal("[" + ", ".join(["'" + item.translate(_ESCAPES) + "'" for item in value]) + "]")
    if all(type(item) is tuple and len(item) == 2 and type(item[0]) is str and type(item[1]) is int for item in value):
        quoted = ["('" + text.translate(_ESCAPES) + "', " + str(number) + ")" for text, number in value]
        return _Literal("[" + ", ".join(quoted) + "]")
    return None
