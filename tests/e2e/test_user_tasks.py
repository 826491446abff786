"""A user's own task from files: a JSONL of items and a tools module, run end to end and refused when broken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from support import SMALL, manifest, miniverl, recipe_dict, write_recipe
from miniverl.engine.core import layout

TOOLS = '''
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: e.g. 12*(3+4)
    """
    if "7" in expression:
        raise ValueError("sevens are not supported")  # the model must read this as a tool error
    a, op, b = expression.partition("*") if "*" in expression else expression.partition("+")
    return str(int(a) * int(b) if op == "*" else int(a) + int(b))
'''


def _items(n: int = 60) -> list[dict]:
    return [{"id": f"q{i}", "prompt": f"What is {100 + i}+{200 + 3 * i}?", "answer": 300 + 4 * i,
             **({"split": "heldout"} if i % 5 == 0 else {})} for i in range(n)]


def _write_task(tmp_path: Path, lines: list[str], tools: str | None = TOOLS) -> Path:
    (tmp_path / "items.jsonl").write_text("\n".join(lines) + "\n")
    task = {"task.name": "jsonl", "task.path": "items.jsonl", "task.judge": "numeric"}
    if tools is not None:
        (tmp_path / "tools.py").write_text(tools)
        task["task.tools"] = "tools.py"
    return write_recipe(tmp_path, recipe_dict(**{**SMALL, **task}))


def test_a_jsonl_task_with_a_tools_module_runs_end_to_end(tmp_path):
    recipe = _write_task(tmp_path, [json.dumps(item) for item in _items()])
    runs = tmp_path / "runs"
    result = miniverl("run", str(recipe), "--runs-dir", str(runs), "--run-id", "mine")
    assert result.returncode == 0, result.stderr
    found = manifest(runs, "mine")
    assert found["verify"]["tasks"] == 8 and found["status"] == "completed"
    # The run keeps the bytes it started with: the user's later edits cannot reach a resume.
    assert (runs / "mine" / "task" / "path.jsonl").read_bytes() == (tmp_path / "items.jsonl").read_bytes()
    assert (runs / "mine" / "task" / "tools.py").read_text() == TOOLS
    (tmp_path / "items.jsonl").write_text("")
    assert miniverl("resume", "mine", "--runs-dir", str(runs)).returncode == 0
    # A copy changed behind the run's back is refused, not silently used.
    (runs / "mine" / "task" / "path.jsonl").write_text(GOOD[0] + "\n")
    refused = miniverl("resume", "mine", "--runs-dir", str(runs))
    assert refused.returncode == 2 and "changed since the run started" in refused.stderr


def test_a_raising_tool_is_a_tool_error_the_model_reads(tmp_path):
    sevens = [{"id": f"s{i}", "prompt": f"What is {170 + i}+{270 + i}?", "answer": 440 + 2 * i,
               **({"split": "heldout"} if i % 4 == 0 else {})} for i in range(40)]
    recipe = _write_task(tmp_path, [json.dumps(item) for item in sevens])
    # The protocol teacher as the student: it calls the tool from the first rollout on.
    data = yaml.safe_load(recipe.read_text())
    data["models"]["student"]["id"] = "miniverl-builtin/protocol_teacher"
    data["artifacts"] = {"keep": "all"}  # cycle 0's rollout is read below
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    runs = tmp_path / "runs"
    result = miniverl("run", str(recipe), "--runs-dir", str(runs), "--run-id", "sevens")
    assert result.returncode == 0, result.stderr
    rollout = (runs / "sevens" / layout.rollout_ref(0).path).read_bytes()
    assert b"error: ValueError: sevens are not supported" in rollout


def _assert_refused(result, *needles: str, runs: Path) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not runs.exists() or not any(runs.iterdir())


GOOD = [json.dumps(item) for item in _items()]
BAD_FILES = {
    "malformed JSON": (GOOD[:3] + ['{"id": "x", "prompt": '] + GOOD[3:], None, ("items.jsonl:4", "JSON")),
    "missing field": (GOOD[:5] + [json.dumps({"id": "y", "prompt": "What is 1+1?"})] + GOOD[5:], None,
                      ("items.jsonl:6", "answer")),
    "duplicate id": (GOOD + [json.dumps({"id": "q1", "prompt": "What is 9+9?", "answer": 18})], None,
                     ("items.jsonl:61", "line 2", "q1")),
    "prompt in both splits": (GOOD + [json.dumps({"id": "z", "prompt": json.loads(GOOD[0])["prompt"], "answer": 1,
                                                  "split": "train"})], None, ("items.jsonl:61", "line 1")),
    "empty split": ([json.dumps({**json.loads(line), "split": "train"}) for line in GOOD], None,
                    ("items.jsonl", "heldout")),
    "tools module fails to import": (GOOD, "import nonexistent_module_for_test\n", ("tools.py", "nonexistent")),
    "tool signature cannot be a schema": (GOOD, 'def add(a, b: int) -> int:\n    """Add."""\n    return a + b\n',
                                          ("tools.py", "add", "a")),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_task_file_is_one_line_and_no_run_directory(tmp_path, case):
    lines, tools, needles = BAD_FILES[case]
    recipe = _write_task(tmp_path, lines, tools if tools is not None else TOOLS)
    runs = tmp_path / "runs"
    _assert_refused(miniverl("run", str(recipe), "--runs-dir", str(runs)), *needles, runs=runs)
    # validate names the same problem without running anything
    checked = miniverl("validate", str(recipe))
    assert checked.returncode == 2 and needles[-1] in checked.stdout + checked.stderr


def test_a_missing_task_file_names_the_key(tmp_path):
    recipe = write_recipe(tmp_path, recipe_dict(**{**SMALL, "task.name": "jsonl", "task.path": "nope.jsonl"}))
    runs = tmp_path / "runs"
    _assert_refused(miniverl("run", str(recipe), "--runs-dir", str(runs)), "task.path", "nope.jsonl", runs=runs)
