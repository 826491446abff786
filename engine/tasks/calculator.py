"""The built-in skill: answer arithmetic questions by calling a calculator tool.

One code path serves the tiny embedded models and the real Qwen3 pair: prompts
are rendered with the tokenizer's own chat template (tools listed, thinking
disabled), tool calls are Qwen3-style `<tool_call>{json}</tool_call>` blocks,
and the tool response is fed back as Qwen3's template renders a `tool`
message. The held-out split is chosen by a hash of the expression, so no
held-out expression can ever appear among training prompts.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from typing import Any

from miniverl.engine.tasks.expression import run_calculator

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12*(3+4)"}},
            "required": ["expression"],
        },
    },
}

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
END_OF_TURN = "<|im_end|>"
# What Qwen3's chat template renders after an assistant turn that called a
# tool: the tool message wrapped as a user turn, then a new assistant prompt
# with thinking disabled.
TOOL_RESPONSE_TEMPLATE = (
    "\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)

QUESTION_TEMPLATES = (
    "What is {e}?",
    "Compute {e}.",
    "Calculate {e}.",
    "Evaluate {e}.",
    "Use the calculator to find {e}.",
)
OPERATORS = ("+", "-", "*")
HELDOUT_BUCKETS = 5  # one expression in five is held out


@dataclass(frozen=True)
class CalcTask:
    task_id: str
    question: str
    expression: str
    answer: int


def split_of(expression: str) -> str:
    digest = hashlib.sha256(expression.encode()).digest()
    return "heldout" if digest[0] % HELDOUT_BUCKETS == 0 else "train"


def make_tasks(split: str, count: int, seed: int, operand_max: int = 999) -> list[CalcTask]:
    """`count` distinct tasks of one split, drawn deterministically from `seed`."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}")
    rng = random.Random(f"calc-tasks/{split}/{seed}/{operand_max}")
    tasks: list[CalcTask] = []
    seen: set[str] = set()
    while len(tasks) < count:
        a, b = rng.randint(10, operand_max), rng.randint(10, operand_max)
        op = rng.choice(OPERATORS)
        expression = f"{a}{op}{b}"
        template = rng.choice(QUESTION_TEMPLATES)
        if expression in seen or split_of(expression) != split:
            continue
        seen.add(expression)
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        tasks.append(CalcTask(f"{split}-{len(tasks):05d}", template.format(e=expression), expression, answer))
    return tasks


def prompt_messages(task: CalcTask) -> list[dict[str, Any]]:
    return [{"role": "user", "content": task.question}]


def render_prompt(tokenizer: Any, task: CalcTask) -> str:
    return tokenizer.apply_chat_template(
        prompt_messages(task),
        tools=[CALCULATOR_TOOL],
        add_generation_prompt=True,
        enable_thinking=False,
        tokenize=False,
    )


def tool_call_text(expression: str) -> str:
    """The tool call exactly as Qwen3 writes it."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"{TOOL_CALL_OPEN}\n{json.dumps(call)}\n{TOOL_CALL_CLOSE}"


def final_answer_text(answer: str) -> str:
    return f"The answer is {answer}."


_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)
_THINK_RE = re.compile(r"<think>.*?</think>", re.S)
_INTEGER_RE = re.compile(r"-?\d+")


@dataclass(frozen=True)
class ToolCall:
    well_formed: bool
    expression: str | None


def parse_tool_calls(turn_text: str) -> list[ToolCall]:
    """Every `<tool_call>` block of one model turn; strictly Qwen3's JSON shape."""
    calls: list[ToolCall] = []
    for block in _TOOL_CALL_RE.findall(turn_text):
        try:
            payload = json.loads(block.strip())
        except json.JSONDecodeError:
            calls.append(ToolCall(False, None))
            continue
        args = payload.get("arguments") if isinstance(payload, dict) else None
        ok = (
            isinstance(payload, dict)
            and set(payload) == {"name", "arguments"}
            and payload["name"] == "calculator"
            and isinstance(args, dict)
            and set(args) == {"expression"}
            and isinstance(args["expression"], str)
        )
        calls.append(ToolCall(bool(ok), args["expression"] if ok else None))
    if TOOL_CALL_OPEN in turn_text and not calls:
        calls.append(ToolCall(False, None))  # opened but never closed
    return calls


def tool_response(call: ToolCall) -> tuple[str, bool]:
    """What the tool returns for one call; malformed calls get an error."""
    if not call.well_formed or call.expression is None:
        return "error: malformed tool call", False
    return run_calculator(call.expression)


def final_answer(turn_text: str) -> str | None:
    """The last integer of the final (tool-free) turn, thinking removed."""
    numbers = _INTEGER_RE.findall(_THINK_RE.sub("", turn_text).replace(END_OF_TURN, ""))
    return numbers[-1] if numbers else None


@dataclass(frozen=True)
class Verdict:
    tool_called: bool
    format_valid: bool
    expression_valid: bool
    result_used: bool
    correct: bool

    @property
    def strict_success(self) -> bool:
        return self.tool_called and self.format_valid and self.expression_valid and self.result_used and self.correct


def judge(task: CalcTask, turns: list[str], tool_results: list[tuple[str, bool]], finished: bool) -> Verdict:
    """Strict verdict on one trajectory.

    `turns` are the model's turn texts in order; `tool_results` the responses
    fed back after each turn that called the tool. Success needs a well-formed
    call, a valid expression, a final answer equal to the last tool result
    (the result was used) and equal to the true answer, and a finished episode.
    """
    calls = [call for turn in turns for call in parse_tool_calls(turn)]
    tool_called = bool(calls)
    format_valid = tool_called and all(call.well_formed for call in calls)
    expression_valid = tool_called and all(ok for _, ok in tool_results) and bool(tool_results)
    last_turn_is_answer = bool(turns) and not parse_tool_calls(turns[-1])
    answer = final_answer(turns[-1]) if last_turn_is_answer else None
    last_result = tool_results[-1][0] if tool_results else None
    result_used = answer is not None and answer == last_result
    correct = finished and answer is not None and answer == str(task.answer)
    return Verdict(tool_called, format_valid, expression_valid, result_used, correct)
