"""The calculator tool: exact, safe arithmetic on what a model writes.

The expression is parsed with :mod:`ast` (never ``eval``); only numbers, ``+ - * / // % **``, unary minus and
parentheses are walked, with :class:`fractions.Fraction` so ``7/2*2`` is exactly 7. Bounds keep a hostile input
cheap: at most 200 characters, exponents up to 10, intermediate values up to 10**15. Anything else raises
:class:`CalcError` with a short reason the agent hands back to the model.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from fractions import Fraction

__all__ = ["CalcError", "calculate", "format_number"]

MAX_CHARS = 200
MAX_ABS = 10**15
MAX_EXPONENT = 10

_BINARY: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: operator.mod,
}


class CalcError(ValueError):
    """The expression is not one the calculator accepts."""


def calculate(expression: str) -> Fraction:
    """The exact value of ``expression``; CalcError when it is not plain arithmetic within the bounds."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalcError("empty expression")
    if len(expression) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalcError(f"not an arithmetic expression: {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        result = Fraction(str(node.value))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        inner = _value(node.operand)
        result = -inner if isinstance(node.op, ast.USub) else inner
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exponent = _value(node.left), _value(node.right)
        if exponent.denominator != 1 or abs(exponent) > MAX_EXPONENT:
            raise CalcError(f"exponents must be whole numbers up to {MAX_EXPONENT}")
        if base == 0 and exponent < 0:
            raise CalcError("division by zero")
        result = base ** int(exponent)
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise CalcError("division by zero")
        result = _BINARY[type(node.op)](left, right)
    else:
        raise CalcError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")
    if abs(result) > MAX_ABS:
        raise CalcError("number out of range")
    return result


def format_number(value: Fraction) -> str:
    """``12`` for whole numbers, else the decimal to 6 places (``3.5``, ``0.333333``)."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")
