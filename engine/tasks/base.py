"""What a task is: its tools, its prompts, its judge, and an oracle where one exists.

A task is the skill being distilled. The engine only ever talks to this
interface: rollout and verify draw `TaskItem`s from `Task.items`, render them
with the tokenizer's chat template and the task's tool schemas, run each tool
call through `Task.run_call` (which never raises: a malformed call, an unknown
tool, arguments that do not fit the schema, a tool that fails or runs past its
budget all become an error text the model reads as the tool response), and
hand the finished `Transcript` to `Task.judge`. The tiny models are trained on
`Task.reference_calls` (the oracle's tool calls) and `Task.final_answer_text`.

Splits are disjoint by construction and items are deterministic in the seed;
`capacity` says how many distinct items a split can ever hold, so a recipe that
asks for more is refused before any work instead of looping forever.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema

SPLITS = ("train", "heldout")
MALFORMED_CALL = "error: malformed tool call"


class TaskError(ValueError):
    """A task cannot serve what was asked of it (too many items, a bad option)."""


@dataclass(frozen=True)
class ToolCall:
    """One `<tool_call>` block as parsed; `error` says why it is not a usable call."""

    name: str | None
    arguments: dict[str, Any] | None
    error: str | None = None

    @property
    def well_formed(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class ToolResult:
    text: str
    ok: bool


class Tool(ABC):
    """One function the model may call: a JSON schema the chat template lists, and a bounded executor."""

    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema of type object

    def schema(self) -> dict[str, Any]:
        """The entry the chat template renders in its tools block (OpenAI function format)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def argument_error(self, arguments: dict[str, Any]) -> str | None:
        """Why `arguments` do not fit the schema, or None."""
        error = jsonschema.exceptions.best_match(self._validator().iter_errors(arguments))
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path)
        return f"{where}: {error.message}" if where else error.message

    def _validator(self) -> Any:
        # Built once per tool: `jsonschema.validate` re-checks the schema itself on every call,
        # which cost the tool loop more than the tool did.
        validator = self.__dict__.get("_schema_validator")
        if validator is None:
            cls = jsonschema.validators.validator_for(self.parameters, default=jsonschema.Draft202012Validator)
            cls.check_schema(self.parameters)
            validator = self.__dict__["_schema_validator"] = cls(self.parameters)
        return validator

    @abstractmethod
    def run(self, arguments: dict[str, Any]) -> ToolResult:
        """Run on schema-checked arguments; bounded in time and output, never raises."""

    def close(self) -> None:
        """Release what the tool holds (a worker process, a database connection)."""


@dataclass(frozen=True)
class TaskItem:
    task_id: str
    question: str
    answer: str  # the gold answer, as text
    reference_calls: tuple[ToolCall, ...] = ()  # the oracle's calls, when the task has an oracle


@dataclass(frozen=True)
class Transcript:
    """One finished trajectory as the judge sees it."""

    turns: tuple[str, ...]  # the model's turn texts, in order
    calls: tuple[tuple[ToolCall, ...], ...]  # per turn, every call after checking against the tools
    results: tuple[tuple[ToolResult, ...], ...]  # per turn, one result per call
    finished: bool  # ended by a final answer, not by a token or turn budget

    @property
    def all_calls(self) -> list[ToolCall]:
        return [c for turn in self.calls for c in turn]

    @property
    def all_results(self) -> list[ToolResult]:
        return [r for turn in self.results for r in turn]

    @property
    def final_text(self) -> str | None:
        """The last turn when it is a final answer (no tool call), else None."""
        return self.turns[-1] if self.turns and not self.calls[-1] else None


@dataclass(frozen=True)
class Verdict:
    """Named checks, in order; strict success is all of them. `tool_called` and `format_valid` are always present."""

    checks: tuple[tuple[str, bool], ...]

    def __getitem__(self, name: str) -> bool:
        return dict(self.checks)[name]

    @property
    def tool_called(self) -> bool:
        return self["tool_called"]

    @property
    def format_valid(self) -> bool:
        return self["format_valid"]

    @property
    def strict_success(self) -> bool:
        return all(ok for _, ok in self.checks)


class Task(ABC):
    name: str
    tools: tuple[Tool, ...] = ()
    files: dict[str, Path] = {}  # recipe key -> the file read (set by tasks.registry; recorded by preflight)

    @abstractmethod
    def capacity(self, split: str) -> int:
        """How many distinct items `split` can hold."""

    @abstractmethod
    def items(self, split: str, count: int, seed: int) -> list[TaskItem]:
        """`count` distinct items of `split`, the same for the same seed; TaskError past `capacity`."""

    @abstractmethod
    def judge(self, item: TaskItem, transcript: Transcript) -> Verdict:
        """The strict verdict on one trajectory."""

    def messages(self, item: TaskItem) -> list[dict[str, Any]]:
        """The conversation the prompt renders (before the first assistant turn)."""
        return [{"role": "user", "content": item.question}]

    def final_answer_text(self, answer: str) -> str:
        """How the oracle words its final turn (what the tiny teachers learn)."""
        return f"The answer is {answer}."

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self.tools]

    def check_call(self, call: ToolCall) -> ToolCall:
        """The call with `error` set when it names no tool of this task or its arguments do not fit."""
        if call.error is not None:
            return call
        tool = self._tool(call.name)
        if tool is None:
            return ToolCall(call.name, call.arguments, f"unknown tool {call.name!r}")
        problem = tool.argument_error(call.arguments or {})
        return ToolCall(call.name, call.arguments, f"invalid arguments: {problem}") if problem else call

    def run_call(self, call: ToolCall) -> ToolResult:
        """What the model reads back for one checked call; never raises."""
        if call.error is not None:
            return ToolResult(self.error_text(call), False)
        tool = self._tool(call.name)
        assert tool is not None and call.arguments is not None
        return tool.run(call.arguments)

    def error_text(self, call: ToolCall) -> str:
        """The tool response to a call that could not run."""
        return f"{MALFORMED_CALL}: {call.error}"

    def close(self) -> None:
        for tool in self.tools:
            tool.close()

    def _tool(self, name: str | None) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    def check_count(self, split: str, count: int) -> None:
        if split not in SPLITS:
            raise TaskError(f"unknown split {split!r}; expected one of {SPLITS}")
        available = self.capacity(split)
        if count > available:
            raise TaskError(f"task {self.name!r} has {available} distinct {split} items; {count} were asked for")


def hash_split(key: str, heldout_buckets: int = 5) -> str:
    """A split decided by a hash of `key`: one key in `heldout_buckets` is held out, forever."""
    digest = hashlib.sha256(key.encode()).digest()
    return "heldout" if digest[0] % heldout_buckets == 0 else "train"


@dataclass
class ItemPool:
    """Every item of a finite task, split once; `draw` picks distinct ones deterministically."""

    by_split: dict[str, list[TaskItem]] = field(default_factory=dict)

    def draw(self, task: Task, split: str, count: int, seed: int) -> list[TaskItem]:
        import random

        task.check_count(split, count)
        pool = self.by_split.get(split, [])
        return random.Random(f"{task.name}/{split}/{seed}").sample(pool, count)
