"""The recipe's `task:` section, turned into a `Task`.

`task.name` is a built-in (`calculator`, `sql`), `jsonl` (the user's items
file, optionally with a tools module), or a Python class named
`package.module:Class` or `path/to/file.py:Class` that implements
`tasks.base.Task`. The files a task reads are resolved against the recipe's
directory once, when a run starts, and copied into the run
(`task_files`/`build_task`), so a resumed run reads exactly the bytes it
started with even if the user edits their file later. Every misuse is one
`RecipeError` line naming the key.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from miniverl.engine.core.errors import RecipeError
from miniverl.engine.core.recipe import Recipe, TaskSpec
from miniverl.engine.tasks.base import Task, TaskError

BUILTINS = ("calculator", "sql", "jsonl")
# Which optional keys each kind of task reads; any other one set is a mistake worth a line.
_OWN_KEYS = {"calculator": {"operand_max"}, "sql": set(), "jsonl": {"path", "judge", "tools"}, "class": {"options"}}
_OPTIONAL_KEYS = ("operand_max", "path", "judge", "tools", "options")


def kind_of(spec: TaskSpec) -> str:
    return spec.name if spec.name in BUILTINS else "class"


def task_files(spec: TaskSpec, base_dir: Path, must_exist: bool = True) -> dict[str, Path]:
    """The files the task reads, by recipe key, resolved against `base_dir` and (by default) checked to exist."""
    _check_keys(spec)
    named: dict[str, str] = {}
    if kind_of(spec) == "jsonl":
        if spec.path is None:
            raise RecipeError("recipe key task.path: a jsonl task needs the path of its .jsonl file")
        named["path"] = spec.path
        if spec.tools is not None:
            named["tools"] = spec.tools
    elif kind_of(spec) == "class":
        module = spec.name.rsplit(":", 1)[0]
        if module.endswith(".py"):
            named["name"] = module
    files: dict[str, Path] = {}
    for key, value in named.items():
        path = Path(value).expanduser()
        path = path if path.is_absolute() else base_dir / path
        if must_exist and not path.is_file():
            raise RecipeError(f"recipe key task.{key}: {path} does not exist; give a path relative to the recipe")
        files[key] = path.resolve() if must_exist else path
    return files


def build_task(spec: TaskSpec, files: dict[str, Path]) -> Task:
    """The task, its files already resolved by `task_files` (or copied into a run)."""
    task = _construct(spec, files)
    task.files = dict(files)
    return task


def _construct(spec: TaskSpec, files: dict[str, Path]) -> Task:
    kind = kind_of(spec)
    if kind == "calculator":
        from miniverl.engine.tasks.calculator import DEFAULT_OPERAND_MAX, CalculatorTask

        return CalculatorTask(spec.operand_max if spec.operand_max is not None else DEFAULT_OPERAND_MAX)
    if kind == "sql":
        from miniverl.engine.tasks.sql import SqlTask

        return SqlTask()
    if kind == "jsonl":
        from miniverl.engine.tasks.jsonl import JsonlTask

        return JsonlTask(files["path"], judge=spec.judge or "exact", tools=files.get("tools"))
    return _build_class(spec, files.get("name"))


def check_counts(recipe: Recipe, task: Task) -> None:
    """Refuse a recipe asking a split for more distinct items than the task has, before any work."""
    asks = (("train", recipe.train.rollouts_per_cycle, "train.rollouts_per_cycle"),
            ("heldout", recipe.task.heldout_size, "task.heldout_size"))
    for split, count, key in asks:
        available = task.capacity(split)
        if count > available:
            raise RecipeError(f"recipe key {key}: {count} asks for more distinct {split} items than task "
                              f"{task.name!r} has ({available}); lower it or give the task more items")


def load_task(recipe: Recipe, base_dir: Path) -> tuple[Task, dict[str, Path]]:
    """The task a recipe names, with its files, its counts checked (what `run`, `validate` and the dry run share)."""
    files = task_files(recipe.task, base_dir)
    try:
        task = build_task(recipe.task, files)
    except TaskError as exc:
        raise RecipeError(f"recipe key task: {exc}") from None
    check_counts(recipe, task)
    return task, files


def _check_keys(spec: TaskSpec) -> None:
    own = _OWN_KEYS[kind_of(spec)]
    for key in _OPTIONAL_KEYS:
        if getattr(spec, key) is not None and key not in own:
            readers = [k for k, keys in _OWN_KEYS.items() if key in keys]
            raise RecipeError(f"recipe key task.{key}: only a {readers[0]} task reads it, not {spec.name!r}; remove it")


def _build_class(spec: TaskSpec, file: Path | None) -> Task:
    module_name, class_name = spec.name.rsplit(":", 1)
    try:
        if file is not None:
            module_spec = importlib.util.spec_from_file_location(f"miniverl_user_task_{file.stem}", file)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_spec.name] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - user code: any failure is one line
        raise RecipeError(f"recipe key task.name: importing {module_name} failed: {type(exc).__name__}: {exc}") from None
    cls: Any = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise RecipeError(f"recipe key task.name: {module_name} has no class {class_name} deriving from "
                          "miniverl.engine.tasks.base.Task")
    try:
        return cls(**(spec.options or {}))
    except Exception as exc:  # noqa: BLE001
        raise RecipeError(f"recipe key task.options: {spec.name}({spec.options or {}}) failed: "
                          f"{type(exc).__name__}: {exc}") from None
