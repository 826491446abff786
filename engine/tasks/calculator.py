"""The built-in skill: answer arithmetic questions by calling a calculator tool.

Questions are `a op b` over operands in [10, operand_max]; the held-out split
is chosen by a hash of the expression (`base.hash_split`), so no held-out
expression can ever appear among training prompts. The tool is the bounded
AST evaluator of `tasks.expression`. The judge is strict: a well-formed call,
every expression valid, a finished episode whose final answer (its last
integer) equals the last tool result and the true answer.
"""

from __future__ import annotations

import random
import re
from typing import Any

from miniverl.engine.tasks.base import MALFORMED_CALL, Task, TaskError, TaskItem, Tool, ToolCall, ToolResult, Transcript, Verdict, hash_split
from miniverl.engine.tasks.expression import run_calculator
from miniverl.engine.tasks.protocol import strip_thinking

QUESTION_TEMPLATES = (
    "What is {e}?",
    "Compute {e}.",
    "Calculate {e}.",
    "Evaluate {e}.",
    "Use the calculator to find {e}.",
)
OPERATORS = ("+", "-", "*")
MIN_OPERAND = 10
DEFAULT_OPERAND_MAX = 999
HELDOUT_SHARE = 0.2  # hash_split holds out one expression in five
_INTEGER_RE = re.compile(r"-?\d+")


class CalculatorTool(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression exactly."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 12*(3+4)"}},
        "required": ["expression"],
        "additionalProperties": False,
    }

    def run(self, arguments: dict[str, Any]) -> ToolResult:
        text, ok = run_calculator(arguments["expression"])
        return ToolResult(text, ok)


def split_of(expression: str) -> str:
    return hash_split(expression)


def final_answer(turn_text: str) -> str | None:
    """The last integer of the final (tool-free) turn, thinking removed."""
    numbers = _INTEGER_RE.findall(strip_thinking(turn_text))
    return numbers[-1] if numbers else None


class CalculatorTask(Task):
    name = "calculator"

    def __init__(self, operand_max: int = DEFAULT_OPERAND_MAX):
        if operand_max < MIN_OPERAND:
            raise TaskError(f"operand_max must be at least {MIN_OPERAND}")
        self.operand_max = operand_max
        self.tools = (CalculatorTool(),)

    def capacity(self, split: str) -> int:
        # Exact for small ranges (where a recipe can ask too much); a lower bound
        # of the hash split's share for large ones, where counting would be slow.
        span = self.operand_max - MIN_OPERAND + 1
        if span <= 200:
            return sum(split_of(f"{a}{op}{b}") == split for a in range(MIN_OPERAND, self.operand_max + 1)
                       for b in range(MIN_OPERAND, self.operand_max + 1) for op in OPERATORS)
        expressions = span * span * len(OPERATORS)
        return int(expressions * (HELDOUT_SHARE if split == "heldout" else 1 - HELDOUT_SHARE) * 0.9)

    def items(self, split: str, count: int, seed: int) -> list[TaskItem]:
        """`count` distinct items of one split, drawn deterministically from `seed`."""
        self.check_count(split, count)
        rng = random.Random(f"calc-tasks/{split}/{seed}/{self.operand_max}")
        items: list[TaskItem] = []
        seen: set[str] = set()
        while len(items) < count:
            a, b = rng.randint(MIN_OPERAND, self.operand_max), rng.randint(MIN_OPERAND, self.operand_max)
            op = rng.choice(OPERATORS)
            expression = f"{a}{op}{b}"
            template = rng.choice(QUESTION_TEMPLATES)
            if expression in seen or split_of(expression) != split:
                continue
            seen.add(expression)
            answer = {"+": a + b, "-": a - b, "*": a * b}[op]
            items.append(TaskItem(f"{split}-{len(items):05d}", template.format(e=expression), str(answer),
                                  (ToolCall("calculator", {"expression": expression}),)))
        return items

    def error_text(self, call: ToolCall) -> str:
        return MALFORMED_CALL  # the tiny models were trained on this exact text

    def judge(self, item: TaskItem, transcript: Transcript) -> Verdict:
        """Strict verdict: a well-formed call, valid expressions, the last result used, the true answer, finished."""
        calls, results = transcript.all_calls, transcript.all_results
        tool_called = bool(calls)
        final = transcript.final_text
        answer = final_answer(final) if final is not None else None
        last_result = results[-1].text if results else None
        return Verdict((
            ("tool_called", tool_called),
            ("format_valid", tool_called and all(c.well_formed for c in calls)),
            ("expression_valid", bool(results) and all(r.ok for r in results)),
            ("result_used", answer is not None and answer == last_result),
            ("correct", transcript.finished and answer is not None and answer == item.answer),
        ))


def expression_of(item: TaskItem) -> str:
    """The item's expression (its oracle call's argument)."""
    return item.reference_calls[0].arguments["expression"]  # type: ignore[index]
