"""A task from the user's own files: items in a JSON-lines file, tools (optional) in a Python module.

Each non-blank line is `{"id": str, "prompt": str, "answer": str | number}`
with an optional `"split": "train" | "heldout"`; without one the split is
`hash_split(prompt)`, so a prompt never moves between splits when lines are
added. The whole file is checked when the task is built, and every problem is
one `TaskFileError` line naming the file, the line and the field.

The judge compares the model's final answer with the gold one: `exact`
(whitespace, case and a trailing period ignored), `numeric` (the last number,
within 1e-6 relative) or `regex:PATTERN` (a full match, `{answer}` standing for
the escaped gold answer). The final answer is the final turn without its
thinking, after its last "answer is" when it says that.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from miniverl.engine.tasks.base import SPLITS, ItemPool, Task, TaskItem, Transcript, Verdict, hash_split
from miniverl.engine.tasks.protocol import strip_thinking
from miniverl.engine.tasks.task_files import TaskFileError, read_task_file
from miniverl.engine.tasks.user_tools import (DEFAULT_MAX_BYTES, DEFAULT_MEMORY_BYTES, DEFAULT_TIMEOUT_S,
                                             load_user_tools)

FIELDS = ("id", "prompt", "answer", "split")
REQUIRED = ("id", "prompt", "answer")
JUDGES = "exact, numeric or regex:PATTERN"
_ANSWER_IS = re.compile(r"answer is", re.IGNORECASE)
# A number as a model writes one: optional sign, thousands commas, decimals, an exponent.
_NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?")

Matcher = Callable[[str, str], bool]  # (extracted final answer, gold answer) -> correct


@dataclass(frozen=True)
class _Line:
    number: int  # 1-based, blank lines counted
    item: TaskItem
    split: str


class JsonlTask(Task):
    name = "jsonl"

    def __init__(self, path: Path, judge: str = "exact", tools: Path | None = None, *,
                 tool_timeout_s: float = DEFAULT_TIMEOUT_S, tool_memory_bytes: int = DEFAULT_MEMORY_BYTES,
                 tool_max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path = Path(path)
        self.judge_spec = judge
        self._task_bytes = read_task_file(self.path, "task file")
        lines = parse_lines(self.path, self._task_bytes)
        check_lines(self.path, lines)
        self._match = make_matcher(judge, self.path, lines)
        self._pool = ItemPool({split: [line.item for line in lines if line.split == split] for split in SPLITS})
        self.tools_path = Path(tools) if tools is not None else None
        self._tools_bytes = read_task_file(self.tools_path, "tools file") if self.tools_path is not None else None
        self.tools = () if self.tools_path is None else load_user_tools(
            self.tools_path, timeout_s=tool_timeout_s, memory_bytes=tool_memory_bytes, max_bytes=tool_max_bytes)

    def capacity(self, split: str) -> int:
        return len(self._pool.by_split.get(split, []))

    def items(self, split: str, count: int, seed: int) -> list[TaskItem]:
        return self._pool.draw(self, split, count, seed)  # checks the count first

    def judge(self, item: TaskItem, transcript: Transcript) -> Verdict:
        """`tool_called`, `format_valid`, `tool_ok` (tools only), `correct`.

        Verdict always carries `tool_called` and `format_valid`. A task without
        tools is judged on its answer, so there `tool_called` is True (no call
        was required) and `format_valid` fails only if the model wrote a call
        anyway (every such call names an unknown tool, so it carries an error).
        """
        calls = transcript.all_calls
        answer = final_answer(transcript)
        correct = transcript.finished and answer is not None and self._match(answer, item.answer)
        if not self.tools:
            return Verdict((("tool_called", True), ("format_valid", all(c.error is None for c in calls)),
                            ("correct", correct)))
        tool_called = bool(calls)
        return Verdict((("tool_called", tool_called),
                        ("format_valid", tool_called and all(c.error is None for c in calls)),
                        ("tool_ok", any(r.ok for r in transcript.all_results)),
                        ("correct", correct)))

    def fingerprint(self) -> str:
        """sha256 of the bytes this task was built from (items file, then tools file), for resume checks."""
        digest = hashlib.sha256()
        for label, data in ((b"task", self._task_bytes), (b"tools", self._tools_bytes)):
            # Length-prefixed, so moving bytes between the two files changes the hash; no tools differs from empty.
            digest.update(label + (b"-" if data is None else str(len(data)).encode()) + b":" + (data or b""))
        return digest.hexdigest()


# --- reading the file ---------------------------------------------------------


def parse_lines(path: Path, data: bytes) -> list[_Line]:
    """Every item line, each checked on its own (its JSON, its fields, their types)."""
    lines: list[_Line] = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a leading BOM is an editor's, not JSON
        except UnicodeDecodeError:
            raise TaskFileError(f"{path}:{number}: not valid UTF-8; save the file as UTF-8") from None
        if text.strip():
            lines.append(_parse_line(path, number, text))
    return lines


def _parse_line(path: Path, number: int, text: str) -> _Line:
    at = f"{path}:{number}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TaskFileError(f"{at}: not valid JSON ({exc.msg} at column {exc.colno}); "
                            "each line is one JSON object") from None
    if not isinstance(obj, dict):
        raise TaskFileError(f'{at}: expected a JSON object like {{"id": ..., "prompt": ..., "answer": ...}}, '
                            f"got {_kind(obj)}")
    for key in obj:
        if key not in FIELDS:
            raise TaskFileError(f'{at}: unknown field {_show(key)}; a line has "id", "prompt", "answer" '
                                'and optionally "split"')
    for key in REQUIRED:
        if key not in obj:
            raise TaskFileError(f'{at}: missing field "{key}"; each line needs "id", "prompt" and "answer"')
    for key in ("id", "prompt"):
        if not isinstance(obj[key], str):
            raise TaskFileError(f'{at}: field "{key}" must be a string, got {_kind(obj[key])}')
        if not obj[key].strip():
            raise TaskFileError(f'{at}: field "{key}" is empty')
    answer = obj["answer"]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise TaskFileError(f'{at}: field "answer" must be a string or a number, got {_kind(answer)}')
    if isinstance(answer, float) and not math.isfinite(answer):
        raise TaskFileError(f'{at}: field "answer" must be a finite number, got {answer}')
    if isinstance(answer, str) and not answer.strip():
        raise TaskFileError(f'{at}: field "answer" is empty')
    split = obj.get("split", hash_split(obj["prompt"]))
    if split not in SPLITS:
        raise TaskFileError(f'{at}: field "split" must be "train" or "heldout", got {_show(split)}')
    return _Line(number, TaskItem(task_id=obj["id"], question=obj["prompt"], answer=str(answer)), split)


def check_lines(path: Path, lines: list[_Line]) -> None:
    """What no single line shows: unique ids, no prompt in both splits, both splits non-empty."""
    if not lines:
        raise TaskFileError(f'{path}: no items; each line is a JSON object like '
                            '{"id": "q1", "prompt": "...", "answer": "..."}')
    first_by_id: dict[str, _Line] = {}
    first_by_prompt: dict[str, _Line] = {}
    for line in lines:
        seen = first_by_id.setdefault(line.item.task_id, line)
        if seen is not line:
            raise TaskFileError(f'{path}:{line.number}: field "id": {_show(line.item.task_id)} is already the id '
                                f"on line {seen.number}; ids must be unique")
        seen = first_by_prompt.setdefault(line.item.question, line)
        if seen.split != line.split:
            raise TaskFileError(f'{path}:{line.number}: field "prompt": the same prompt is in {line.split} here and '
                                f"in {seen.split} on line {seen.number}; a held-out prompt must never be trained "
                                "on, so put both lines in one split or remove one")
    for split in SPLITS:
        if not any(line.split == split for line in lines):
            raise TaskFileError(f'{path}: no {split} items; add "split": "{split}" to some lines or add more lines')


def _kind(value: Any) -> str:
    """A JSON value's kind, as the user wrote it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "an array", str: "a string"}.get(type(value), "a number")


def _show(value: Any, limit: int = 60) -> str:
    """A user value quoted on one line, shortened."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + '..."'


# --- judging ------------------------------------------------------------------


def final_answer(transcript: Transcript) -> str | None:
    """The final turn without thinking, after its last "answer is" if it says that; None when it never answered."""
    text = transcript.final_text
    if text is None:
        return None
    text = strip_thinking(text)
    said = list(_ANSWER_IS.finditer(text))
    return (text[said[-1].end():] if said else text).strip()


def normalize(text: str) -> str:
    """For `exact`: whitespace collapsed, case folded, one trailing period dropped."""
    text = " ".join(text.split()).casefold()
    return text[:-1].rstrip() if text.endswith(".") else text


def last_number(text: str) -> float | None:
    numbers = _NUMBER_RE.findall(text)
    return float(numbers[-1].replace(",", "")) if numbers else None


def make_matcher(spec: str, path: Path, lines: list[_Line]) -> Matcher:
    """The recipe's `task.judge` as a function; a bad value, or a gold answer it cannot judge, is TaskFileError."""
    if spec == "exact":
        return lambda got, gold: normalize(got) == normalize(gold)
    if spec == "numeric":
        for line in lines:
            if _as_number(line.item.answer) is None:
                raise TaskFileError(f'{path}:{line.number}: field "answer": {_show(line.item.answer)} is not a '
                                    'number, and judge "numeric" compares numbers; fix it or use judge "exact"')
        return _numeric_match
    if spec.startswith("regex:"):
        return _regex_matcher(spec, lines)
    raise TaskFileError(f"recipe key task.judge: {_show(spec)} is not a judge; use {JUDGES}")


def _as_number(text: str) -> float | None:
    try:
        value = float(text.strip().replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _numeric_match(got: str, gold: str) -> bool:
    value, expected = last_number(got), _as_number(gold)
    # Relative only, as documented; a gold answer of 0 then needs an exact 0 (isclose(0, 0) holds).
    return value is not None and expected is not None and math.isclose(value, expected, rel_tol=1e-6)


def _regex_matcher(spec: str, lines: list[_Line]) -> Matcher:
    pattern = spec[len("regex:"):]
    if not pattern:
        raise TaskFileError('recipe key task.judge: "regex:" needs a pattern after the colon, e.g. "regex:{answer}"')
    compiled: dict[str, re.Pattern[str]] = {}
    for gold in {line.item.answer for line in lines} if "{answer}" in pattern else {""}:
        try:
            compiled[gold] = re.compile(pattern.replace("{answer}", re.escape(gold)))
        except re.error as exc:
            raise TaskFileError(f"recipe key task.judge: {_show(spec)} does not compile: {exc}") from None
    per_gold = "{answer}" in pattern

    def match(got: str, gold: str) -> bool:
        key = gold if per_gold else ""
        regex = compiled.get(key) or re.compile(pattern.replace("{answer}", re.escape(gold)))
        # The oracle ends with a period ("The answer is 42."), so a pattern may match with or without it.
        return bool(regex.fullmatch(got) or (got.endswith(".") and regex.fullmatch(got[:-1].rstrip())))

    return match
