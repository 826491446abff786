"""The calculator tool: a bounded arithmetic evaluator over a parsed AST.

Model output is hostile input. Nothing here calls `eval`/`exec`; the
expression is parsed with `ast.parse(mode="eval")` and only numeric literals,
unary +/- and the binary operators + - * / // % ** are interpreted. Every
intermediate result is bounded in magnitude, exponents are bounded before they
are computed, and the input length and nesting depth are capped, so `9**9**9`
or a deeply nested expression becomes a `CalculatorError` (which the rollout
shows the model as a tool error) instead of a hang or a crash.
"""

from __future__ import annotations

import ast
import math
from fractions import Fraction

MAX_EXPRESSION_CHARS = 200
MAX_DEPTH = 32
MAX_ABS_VALUE = 10**30
MAX_EXPONENT = 64
MAX_NODES = 128


class CalculatorError(ValueError):
    """The expression is malformed, unsupported or out of bounds."""


def _check_bound(value: Fraction) -> Fraction:
    if abs(value) > MAX_ABS_VALUE:
        raise CalculatorError("result too large")
    # A huge denominator is as much of a memory bomb as a huge numerator.
    if value.denominator > MAX_ABS_VALUE:
        raise CalculatorError("result too precise")
    return value


def _evaluate(node: ast.AST, depth: int) -> Fraction:
    if depth > MAX_DEPTH:
        raise CalculatorError("expression nested too deeply")
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError("only numbers are allowed")
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise CalculatorError("number is not finite")
        return _check_bound(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        operand = _evaluate(node.operand, depth + 1)
        return operand if isinstance(node.op, ast.UAdd) else -operand
    if isinstance(node, ast.BinOp):
        left = _evaluate(node.left, depth + 1)
        right = _evaluate(node.right, depth + 1)
        return _check_bound(_apply(node.op, left, right))
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


def _apply(op: ast.operator, left: Fraction, right: Fraction) -> Fraction:
    if isinstance(op, ast.Add):
        return left + right
    if isinstance(op, ast.Sub):
        return left - right
    if isinstance(op, ast.Mult):
        return left * right
    if isinstance(op, (ast.Div, ast.FloorDiv, ast.Mod)):
        if right == 0:
            raise CalculatorError("division by zero")
        if isinstance(op, ast.Div):
            return left / right
        if isinstance(op, ast.FloorDiv):
            return Fraction(left // right)
        return left % right
    if isinstance(op, ast.Pow):
        # Bound the exponent before computing: 9**9**9 must never be evaluated.
        if right.denominator != 1:
            raise CalculatorError("only integer exponents are allowed")
        if abs(right) > MAX_EXPONENT:
            raise CalculatorError("exponent too large")
        if left == 0 and right < 0:
            raise CalculatorError("division by zero")
        if left != 0 and abs(right) * math.log10(max(abs(left), 1 / abs(left))) > 30:
            raise CalculatorError("result too large")
        return left ** int(right)
    raise CalculatorError(f"unsupported operator: {type(op).__name__}")


def evaluate(expression: str) -> Fraction:
    """Evaluate an arithmetic expression exactly, or raise CalculatorError."""
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError("expression too long")
    # Python's own parser recurses per nesting level; cap parentheses first so
    # parsing itself stays bounded.
    if expression.count("(") > MAX_DEPTH:
        raise CalculatorError("expression nested too deeply")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise CalculatorError("invalid expression") from exc
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError("expression too complex")
    return _evaluate(tree.body, 0)


def format_number(value: Fraction) -> str:
    """Integers print exactly; other values print as a short decimal."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6g}"


def run_calculator(expression: str) -> tuple[str, bool]:
    """The tool as the model sees it: (response text, ok)."""
    try:
        return format_number(evaluate(expression)), True
    except CalculatorError as exc:
        return f"error: {exc}", False
