"""The recipe's `task:` section: which task it builds, which keys each kind reads, and what it refuses up front."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from support import SMALL, recipe_dict
from miniverl.engine.core.errors import RecipeError
from miniverl.engine.core.recipe import parse_recipe
from miniverl.engine.tasks import registry
from miniverl.engine.tasks.calculator import CalculatorTask
from miniverl.engine.tasks.sql import SqlTask


def _recipe(**task):
    return parse_recipe(yaml.safe_dump(recipe_dict(**{**SMALL, **{f"task.{k}": v for k, v in task.items()}})))


def test_the_builtins_are_built_from_their_names(tmp_path):
    calc, files = registry.load_task(_recipe(), tmp_path)
    assert isinstance(calc, CalculatorTask) and calc.operand_max == 999 and files == {}
    assert registry.load_task(_recipe(operand_max=50), tmp_path)[0].operand_max == 50
    assert isinstance(registry.load_task(_recipe(name="sql"), tmp_path)[0], SqlTask)


def test_an_unknown_task_name_is_a_schema_error():
    with pytest.raises(RecipeError, match="task.name"):
        _recipe(name="chess")


@pytest.mark.parametrize("task,needle", [
    ({"path": "x.jsonl"}, "task.path: only a jsonl task reads it"),
    ({"name": "sql", "operand_max": 20}, "task.operand_max: only a calculator task reads it"),
    ({"name": "jsonl"}, "task.path: a jsonl task needs"),
    ({"name": "jsonl", "path": "missing.jsonl"}, "task.path:"),
])
def test_keys_of_another_kind_of_task_are_refused(tmp_path, task, needle):
    with pytest.raises(RecipeError, match=needle):
        registry.load_task(_recipe(**task), tmp_path)


def test_a_split_asked_for_more_items_than_it_has_is_refused_before_any_work(tmp_path):
    # Three expressions in all (10+10, 10-10, 10*10): neither split can hold 8 distinct items.
    with pytest.raises(RecipeError, match=r"train.rollouts_per_cycle: 8 asks for more distinct train items .* \(1\)"):
        registry.load_task(_recipe(operand_max=10), tmp_path)
    with pytest.raises(RecipeError, match=r"task.heldout_size: 100000 .* \(149\)"):
        registry.load_task(_recipe(name="sql", heldout_size=100000), tmp_path)


CLASS_TASK = '''
from miniverl.engine.tasks.base import Task, TaskItem, Verdict


class Echo(Task):
    name = "echo"

    def __init__(self, words=("a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l"), loud=False):
        self.words = [w.upper() if loud else w for w in words]

    def capacity(self, split):
        return len(self.words)

    def items(self, split, count, seed):
        self.check_count(split, count)
        return [TaskItem(f"{split}-{i}", f"Say {w}.", w) for i, w in enumerate(self.words[:count])]

    def judge(self, item, transcript):
        said = transcript.final_text or ""
        return Verdict((("tool_called", True), ("format_valid", True), ("correct", item.answer in said)))
'''


def test_a_python_class_names_its_file_and_gets_its_options(tmp_path):
    (tmp_path / "echo_task.py").write_text(CLASS_TASK)
    task, files = registry.load_task(_recipe(name="echo_task.py:Echo", options={"loud": True}), tmp_path)
    assert task.name == "echo" and task.words[0] == "A"
    assert files == {"name": (tmp_path / "echo_task.py").resolve()}


@pytest.mark.parametrize("source,name,needle", [
    (CLASS_TASK, "echo_task.py:Missing", "has no class Missing"),
    ("class Echo:\n    pass\n", "echo_task.py:Echo", "deriving from miniverl.engine.tasks.base.Task"),
    ("raise RuntimeError('boom')\n", "echo_task.py:Echo", "RuntimeError: boom"),
    (CLASS_TASK, "no_such_module_here:Echo", "importing no_such_module_here failed"),
])
def test_a_class_that_cannot_be_built_is_one_line(tmp_path, source, name, needle):
    (tmp_path / "echo_task.py").write_text(source)
    with pytest.raises(RecipeError, match=needle) as raised:
        registry.load_task(_recipe(name=name), tmp_path)
    assert "\n" not in str(raised.value)


def test_bad_options_name_the_key(tmp_path):
    (tmp_path / "echo_task.py").write_text(CLASS_TASK)
    with pytest.raises(RecipeError, match="task.options"):
        registry.load_task(_recipe(name="echo_task.py:Echo", options={"colour": "red"}), tmp_path)


def test_paths_are_relative_to_the_recipe(tmp_path: Path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "items.jsonl").write_text("")
    files = registry.task_files(_recipe(name="jsonl", path="sub/items.jsonl").task, tmp_path)
    assert files == {"path": (tmp_path / "sub" / "items.jsonl").resolve()}
