"""The ``calculator`` tool: exact arithmetic on ints and floats, parsed with ``ast``, never ``eval``.

What this is: a Tool (rlctl.contracts.roles) whose arguments are one
arithmetic expression: ``+ - * / // % **``, unary ``+``/``-``, parentheses,
int and float literals. Sizes are bounded (expression length, integer bits,
exponents), so no call can run long or eat memory. A bad expression (syntax,
a name, division by zero, a number past the bounds) is the policy's mistake:
it raises ``BadToolCall`` and the environment shows the message to the policy.

What this is not: a symbolic algebra system (no names, functions or sympy).
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from rlctl.contracts.errors import BadToolCall

VERSION = "1"

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_chars: int = Field(200, ge=1, le=10_000, description="Longest expression accepted.")
    max_bits: int = Field(256, ge=8, le=4096, description="Largest integer (in bits) any step may produce.")


class Calculator:
    """Evaluates one arithmetic expression.

    >>> Calculator().call("37*48", 1.0)
    '1776'
    >>> Calculator().call("(2+3)**2 // 4", 1.0)
    '6'
    """

    name = "calculator"
    version = VERSION

    def __init__(self, options: CalculatorOptions | None = None) -> None:
        self.options = options or CalculatorOptions()

    def call(self, arguments: str, timeout_s: float) -> str:
        return format_number(self.evaluate(arguments))

    def evaluate(self, text: str) -> int | float:
        """The value of ``text``; raises BadToolCall saying what is wrong with it."""
        text = text.strip()
        if not text:
            raise BadToolCall("empty expression")
        if len(text) > self.options.max_chars:
            raise BadToolCall(f"expression longer than {self.options.max_chars} characters")
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError:
            raise BadToolCall(f"cannot parse {text[:40]!r}") from None
        return self._value(tree.body)

    def _value(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return self._checked(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self._checked(_UNARY[type(node.op)](self._value(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._value(node.left), self._value(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            try:
                return self._checked(_BINARY[type(node.op)](left, right))
            except ZeroDivisionError:
                raise BadToolCall("division by zero") from None
            except OverflowError:
                raise BadToolCall("result too large") from None
        what = type(node).__name__ if not isinstance(node, ast.Name) else f"name {node.id!r}"
        raise BadToolCall(f"unsupported {what}: only numbers, + - * / // % ** and parentheses")

    def _check_power(self, base: int | float, exponent: int | float) -> None:
        if abs(exponent) > self.options.max_bits:
            raise BadToolCall(f"exponent {exponent} too large")
        if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
            if max(abs(base), 1).bit_length() * exponent > self.options.max_bits * 2:
                raise BadToolCall("result too large")

    def _checked(self, value: Any) -> int | float:
        if isinstance(value, complex):
            raise BadToolCall("complex result")
        if isinstance(value, int) and value.bit_length() > self.options.max_bits:
            raise BadToolCall("result too large")
        if isinstance(value, float) and not math.isfinite(value):
            raise BadToolCall("result is not a finite number")
        return value


def format_number(value: int | float) -> str:
    """Ints as digits; floats in Python's shortest round-trip form (``0.5``, ``2.0``)."""
    return str(value) if isinstance(value, int) else repr(value)
