"""A safe evaluator for the ``calc`` tool: integer ``+``, ``-``, ``*`` and parentheses, nothing else.

The expression is parsed with :mod:`ast` and only integer literals, unary minus and those three binary
operators are walked; anything else (names, calls, attributes, floats, huge numbers) is a :class:`CalcError`.
No ``eval`` of model output ever happens.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable

from fulmen.schemas.errors import PoisonInputError

__all__ = ["CalcError", "evaluate"]

MAX_CHARS = 40
MAX_ABS = 10**9

_BINARY: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
}


class CalcError(PoisonInputError):
    """The expression is not one the calculator accepts."""


def evaluate(expression: str) -> int:
    """The integer value of ``expression`` (e.g. ``"23+45"`` -> 68); CalcError when it is not allowed."""
    if not isinstance(expression, str) or not expression.strip() or len(expression) > MAX_CHARS:
        raise CalcError(f"expression must be a non-empty string of at most {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalcError(f"not an expression: {expression!r}") from exc
    return _value(tree.body)


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        result = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        result = -_value(node.operand)
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        result = _BINARY[type(node.op)](_value(node.left), _value(node.right))
    else:
        raise CalcError(f"unsupported element {type(node).__name__}")
    if abs(result) > MAX_ABS:
        raise CalcError("number out of range")
    return result
