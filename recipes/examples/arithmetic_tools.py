"""The tools of the `arithmetic.jsonl` example: plain functions, type hints and docstrings.

miniverl turns each public function into a tool: its name, the first paragraph
of its docstring, and a JSON schema of its parameters (from the type hints and
the `Args:` section). The functions run in a separate worker process with a
time, memory and output budget, so a bug here becomes a tool error the model
reads, never a crashed run.
"""

import ast
import operator

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: integers joined by +, - and *, e.g. 12*(3+4)
    """

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and abs(node.value) < 10**12:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("invalid expression")

    if len(expression) > 200:
        raise ValueError("expression too long")
    return str(value(ast.parse(expression, mode="eval").body))
