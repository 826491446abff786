"""The JSON-lines task: every bad file is one line naming where, splits, items, judges, tools."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miniverl.engine.core.errors import UserError
from miniverl.engine.tasks.base import TaskError, ToolCall, ToolResult, Transcript, hash_split
from miniverl.engine.tasks.jsonl import JsonlTask, final_answer, normalize
from miniverl.engine.tasks.task_files import TaskFileError


def _prompts(split: str, count: int) -> list[str]:
    """Prompts `hash_split` puts in `split` (found by the same hash the task uses, not by its code)."""
    found = [p for p in (f"What is {i} + {i}?" for i in range(500)) if hash_split(p) == split]
    return found[:count]


GOOD = ([{"id": f"t{i}", "prompt": p, "answer": 2 * int(p.split()[2])} for i, p in enumerate(_prompts("train", 12))]
        + [{"id": f"h{i}", "prompt": p, "answer": str(2 * int(p.split()[2]))}
           for i, p in enumerate(_prompts("heldout", 4))])


def _write(tmp_path: Path, lines: list[object], name: str = "items.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def _transcript(final: str, calls: tuple[ToolCall, ...] = (), results: tuple[ToolResult, ...] = (),
                finished: bool = True) -> Transcript:
    turns = (("<tool_call>...</tool_call>",) if calls else ()) + (final,)
    return Transcript(turns, ((calls,) if calls else ()) + ((),), ((results,) if calls else ()) + ((),), finished)


# --- bad files ----------------------------------------------------------------

ONE = {"id": "a", "prompt": "What is 1 + 1?", "answer": 2, "split": "train"}
TWO = {"id": "b", "prompt": "What is 2 + 2?", "answer": 4, "split": "heldout"}

BAD_FILES = [
    # (lines, the 1-based line named, what the message must also say)
    ([ONE, "", '{"id": "b", "prompt": '], 3, "not valid JSON"),
    ([ONE, "[1, 2]"], 2, "expected a JSON object"),
    ([ONE, {"id": "b", "prompt": "p"}], 2, 'missing field "answer"'),
    ([ONE, {"prompt": "p", "answer": 1}], 2, 'missing field "id"'),
    ([ONE, {"id": 7, "prompt": "p", "answer": 1}], 2, 'field "id" must be a string'),
    ([ONE, {"id": "b", "prompt": ["p"], "answer": 1}], 2, 'field "prompt" must be a string'),
    ([ONE, {"id": "b", "prompt": "p", "answer": [1]}], 2, 'field "answer" must be a string or a number, got an array'),
    ([ONE, {"id": "b", "prompt": "p", "answer": True}], 2, 'field "answer" must be a string or a number'),
    ([ONE, {"id": "b", "prompt": "p", "anwser": 1}], 2, 'unknown field "anwser"'),
    ([ONE, {"id": "b", "prompt": "p", "answer": 1, "split": "test"}], 2, 'field "split" must be "train" or "heldout"'),
    ([ONE, TWO, {**TWO, "prompt": "other"}], 3, 'field "id": "b" is already the id on line 2'),
    ([ONE, TWO, "", {**ONE, "id": "c", "split": "heldout"}], 4, 'field "prompt": the same prompt is in heldout here '
                                                                "and in train on line 1"),
]


@pytest.mark.parametrize(("lines", "number", "expected"), BAD_FILES)
def test_bad_lines_are_one_line_naming_file_line_and_field(tmp_path: Path, lines, number: int, expected: str) -> None:
    path = _write(tmp_path, lines)
    with pytest.raises(TaskFileError) as info:
        JsonlTask(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}:{number}: ") and expected in message, message
    assert isinstance(info.value, UserError) and info.value.exit_code == 2


def test_an_empty_split_says_how_to_fill_it(tmp_path: Path) -> None:
    with pytest.raises(TaskFileError) as info:
        JsonlTask(_write(tmp_path, [ONE, {**ONE, "id": "c", "prompt": "other"}]))
    assert str(info.value) == (f'{tmp_path / "items.jsonl"}: no heldout items; add "split": "heldout" to some lines '
                               "or add more lines")
    with pytest.raises(TaskFileError, match="no train items"):
        JsonlTask(_write(tmp_path, [TWO]))
    with pytest.raises(TaskFileError, match="no items"):
        JsonlTask(_write(tmp_path, ["", "  "]))


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(TaskFileError, match=r"absent\.jsonl: no such task file"):
        JsonlTask(tmp_path / "absent.jsonl")


@pytest.mark.parametrize(("judge", "expected"), [
    ("fuzzy", 'recipe key task.judge: "fuzzy" is not a judge; use exact, numeric or regex:PATTERN'),
    ("regex:(", 'recipe key task.judge: "regex:(" does not compile: missing ), unterminated subpattern'),
    ("regex:", 'recipe key task.judge: "regex:" needs a pattern'),
])
def test_bad_judges_are_one_line(tmp_path: Path, judge: str, expected: str) -> None:
    with pytest.raises(TaskFileError) as info:
        JsonlTask(_write(tmp_path, [ONE, TWO]), judge=judge)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)


def test_numeric_judge_needs_numeric_answers(tmp_path: Path) -> None:
    path = _write(tmp_path, [ONE, {**TWO, "answer": "four"}])
    with pytest.raises(TaskFileError, match=r'items\.jsonl:2: field "answer": "four" is not a number'):
        JsonlTask(path, judge="numeric")


# --- splits and items ---------------------------------------------------------


def test_splits_follow_the_hash_unless_given(tmp_path: Path) -> None:
    assert hash_split(GOOD[0]["prompt"]) == "train"
    task = JsonlTask(_write(tmp_path, [{**GOOD[0], "split": "heldout"}, *GOOD[1:]]))  # held out explicitly
    train = {i.task_id for i in task.items("train", task.capacity("train"), seed=0)}
    heldout = {i.task_id for i in task.items("heldout", task.capacity("heldout"), seed=0)}
    assert train == {line["id"] for line in GOOD[1:] if hash_split(line["prompt"]) == "train"}
    assert heldout == {line["id"] for line in GOOD if hash_split(line["prompt"]) == "heldout"} | {"t0"}
    assert (task.capacity("train"), task.capacity("heldout")) == (11, 5)


def test_items_are_distinct_and_deterministic(tmp_path: Path) -> None:
    task = JsonlTask(_write(tmp_path, GOOD))
    first = task.items("train", 8, seed=3)
    assert first == task.items("train", 8, seed=3) and len({i.task_id for i in first}) == 8
    assert [i.task_id for i in task.items("train", 8, seed=4)] != [i.task_id for i in first]
    item = next(i for i in task.items("train", 12, seed=0) if i.task_id == "t0")
    assert (item.question, item.answer, item.reference_calls) == (GOOD[0]["prompt"], str(GOOD[0]["answer"]), ())
    with pytest.raises(TaskError, match="has 12 distinct train items; 13 were asked for"):
        task.items("train", 13, seed=0)


def test_fingerprint_follows_the_file_bytes(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD)
    same = JsonlTask(path).fingerprint()
    assert same == JsonlTask(path).fingerprint() and len(same) == 64
    path.write_text(path.read_text() + "\n")
    assert JsonlTask(path).fingerprint() != same


# --- judging ------------------------------------------------------------------


def test_final_answer_extraction() -> None:
    assert final_answer(_transcript("<think>the answer is 3</think>So the Answer is  42 .<|im_end|>")) == "42 ."
    assert final_answer(_transcript("Paris")) == "Paris"
    assert final_answer(Transcript(("<tool_call>x</tool_call>",), ((ToolCall("f", {}),),), ((),), False)) is None
    assert normalize("  The   Eiffel Tower. ") == "the eiffel tower"


def _correct(task: JsonlTask, answer: str, final: str, finished: bool = True) -> bool:
    from miniverl.engine.tasks.base import TaskItem

    return task.judge(TaskItem("x", "q", answer), _transcript(final, finished=finished))["correct"]


def test_exact_judge(tmp_path: Path) -> None:
    task = JsonlTask(_write(tmp_path, [ONE, TWO]))
    assert _correct(task, "New York", "The answer is new   york.")
    assert _correct(task, "New York", task.final_answer_text("New York"))
    assert not _correct(task, "New York", "The answer is York.")
    assert not _correct(task, "New York", "The answer is New York.", finished=False)


def test_numeric_judge(tmp_path: Path) -> None:
    task = JsonlTask(_write(tmp_path, [ONE, TWO]), judge="numeric")
    assert _correct(task, "1234.5", "Adding them up gives 1,234.5000001")
    assert _correct(task, "-3", "The answer is -3.0.")
    assert _correct(task, "0", "The answer is 0")
    assert not _correct(task, "1234.5", "about 1234.6")
    assert not _correct(task, "7", "no number here")


def test_regex_judge(tmp_path: Path) -> None:
    task = JsonlTask(_write(tmp_path, [ONE, {**TWO, "answer": "1+1"}]), judge=r"regex:(?:\$ ?)?{answer}( dollars)?")
    assert _correct(task, "1+1", "The answer is $ 1+1 dollars")
    assert _correct(task, "1+1", task.final_answer_text("1+1"))  # the oracle's trailing period is allowed
    assert not _correct(task, "1+1", "The answer is 11")  # the gold answer is escaped, not a pattern
    digits = JsonlTask(_write(tmp_path, [ONE, TWO]), judge=r"regex:\d{2}")
    assert _correct(digits, "ignored", "The answer is 42") and not _correct(digits, "ignored", "The answer is 421")


def test_verdict_without_tools_is_the_answer(tmp_path: Path) -> None:
    task = JsonlTask(_write(tmp_path, [ONE, TWO]))
    item = task.items("train", 1, seed=0)[0]
    verdict = task.judge(item, _transcript("The answer is 2."))
    assert verdict.checks == (("tool_called", True), ("format_valid", True), ("correct", True))
    assert verdict.strict_success
    # A call the task cannot serve fails the format check.
    stray = task.check_call(ToolCall("calculator", {"expression": "1+1"}))
    assert not task.judge(item, _transcript("The answer is 2.", (stray,), (ToolResult("error", False),))).format_valid


TOOLS = '''
import time


def double(x: int) -> int:
    """Double a number.

    Args:
        x: the number
    """
    return 2 * x


def broken(x: int) -> int:
    """Always fails."""
    raise ValueError(f"cannot do {x}")


def stall() -> int:
    """Never answers."""
    time.sleep(60)
'''


def test_a_task_with_tools(tmp_path: Path) -> None:
    tools_path = tmp_path / "my_tools.py"
    tools_path.write_text(TOOLS)
    items_path = _write(tmp_path, [ONE, TWO])
    task = JsonlTask(items_path, judge="numeric", tools=tools_path, tool_timeout_s=0.5)
    try:
        assert [s["function"]["name"] for s in task.tool_schemas()] == ["double", "broken", "stall"]
        call = task.check_call(ToolCall("double", {"x": 1}))
        result = task.run_call(call)
        assert result == ToolResult("2", True)
        item = task.items("train", 1, seed=0)[0]
        verdict = task.judge(item, _transcript("The answer is 2.", (call,), (result,)))
        assert verdict.checks == (("tool_called", True), ("format_valid", True), ("tool_ok", True), ("correct", True))
        # No call: the answer alone is not enough.
        assert task.judge(item, _transcript("The answer is 2.")).checks[:3] == (
            ("tool_called", False), ("format_valid", False), ("tool_ok", False))
        # A tool that raises or stalls is a tool error, never a crash of the run.
        assert task.run_call(task.check_call(ToolCall("broken", {"x": 3}))) == ToolResult(
            "error: ValueError: cannot do 3", False)
        assert task.run_call(task.check_call(ToolCall("stall", {}))) == ToolResult(
            "error: tool stall timed out after 0.5 s", False)
        bad = task.check_call(ToolCall("double", {"x": "one"}))
        assert bad.error is not None and not task.run_call(bad).ok
        assert task.run_call(task.check_call(ToolCall("double", {"x": 21}))).text == "42"
        fingerprint = task.fingerprint()
        tools_path.write_text(TOOLS + "\n")
        assert JsonlTask(items_path, tools=tools_path).fingerprint() != fingerprint
    finally:
        task.close()
