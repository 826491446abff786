"""`miniverl validate`: every problem of a recipe at once, then what it resolves to here.

msgspec stops at the first error, which makes a user fix a recipe one key per
attempt. So the YAML is first checked against the JSON Schema of the Recipe
Struct (engine.core.recipe.schema_problems), which lists every unknown key,
missing key, wrong type and out-of-range value. Keys that failed are dropped
(their defaults stand in) so that the rules spanning several keys, the `auto`
resolutions and the model locations can still be checked in the same pass; a
later problem that names a key which already failed is not repeated.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from miniverl.engine.models.memory_plan import PLANNED_KEYS
from miniverl.engine.core.artifacts import Resolution
from miniverl.engine.core.device import (
    check_quantization, resolve_activation_offload, resolve_device, resolve_dtype, resolve_fused_kernels,
    resolve_memory_strategy, resolve_optimizer,
)
from miniverl.engine.core.errors import RecipeError, UserError
from miniverl.engine.core.recipe import (
    Recipe, consistency_problems, decode_recipe, dotted, load_recipe_data, problem_line, read_recipe_text,
    recipe_to_builtins, schema_problems, text_with_overrides,
)
from miniverl.engine.core.schema_check import KeyPath
from miniverl.engine.tasks import registry


@dataclass
class Validation:
    source: str
    problems: list[str] = field(default_factory=list)
    recipe: Recipe | None = None
    data: dict = field(default_factory=dict)
    resolved: dict[str, Resolution] = field(default_factory=dict)  # recipe key -> value and reason
    model_dirs: dict[str, Path] = field(default_factory=dict)  # role -> local directory


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else str(key)


def _without(data: dict, paths: list[KeyPath]) -> dict:
    """A copy of `data` lacking every key at fault, so that defaults stand in for them.

    A bad list entry drops its whole list (`lora.target_modules.1` drops `lora.target_modules`)."""
    kept = copy.deepcopy(data)
    for path in paths:
        keys = path[: next((i for i, key in enumerate(path) if isinstance(key, int)), len(path))]
        node: Any = kept
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if keys and isinstance(node, dict):
            node.pop(keys[-1], None)
    return kept


# ---------------------------------------------------------------- checks that need a whole recipe
def _attempt(problems: list[str], check, *args):
    try:
        return check(*args)
    except UserError as exc:
        problems.append(str(exc))
        return None


def resolve_here(recipe: Recipe, problems: list[str]) -> dict[str, Resolution]:
    """Each `auto` key's value on this machine and why, collecting every refusal."""
    resolved: dict[str, Resolution] = {}
    device = _attempt(problems, resolve_device, recipe.models.device)
    if device is None:  # cuda asked for but not usable: the other keys are judged as for CUDA
        return resolved
    resolved["models.device"] = device
    _attempt(problems, check_quantization, recipe.models.student.quantization, device.value)
    quantized = recipe.models.student.quantization == "nf4"
    for key, check, args in (
        ("dtype", resolve_dtype, (recipe.dtype, device.value)),
        ("memory.strategy", resolve_memory_strategy, (recipe.memory.strategy, quantized, device.value)),
        ("optimizer.name", resolve_optimizer, (recipe.optimizer.name, device.value)),
        ("train.offload_activations", resolve_activation_offload,
         (recipe.train.offload_activations, recipe.train.gradient_checkpointing, device.value)),
        ("train.fused_kernels", resolve_fused_kernels, (recipe.train.fused_kernels, device.value)),
    ):
        value = _attempt(problems, check, *args)
        if value is not None:
            resolved[key] = value
    return resolved


def locate_models(recipe: Recipe, problems: list[str]) -> dict[str, Path]:
    from miniverl.engine.models.loading import locate_model

    found = {}
    for role in ("student", "teacher"):
        spec = getattr(recipe.models, role)
        directory = _attempt(problems, locate_model, role, spec.id, spec.revision, spec.path)
        if directory is not None:
            found[role] = directory
    return found


def _names_failed_key(message: str, failed: set[str]) -> bool:
    return any(re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", message) for key in failed)


def check_task(recipe: Recipe, base_dir: Path) -> None:
    """The task's files, tools and split sizes, checked as `run` checks them (tasks.registry.load_task)."""
    task, _ = registry.load_task(recipe, base_dir)
    task.close()


def validate_text(text: str, source: str, base_dir: Path | None = None) -> Validation:
    """`base_dir`: where the recipe's relative task paths start (default: the directory of `source`)."""
    result = Validation(source)
    try:
        data = load_recipe_data(text, source)
    except RecipeError as exc:
        result.problems.append(str(exc))
        return result
    result.data = data
    found = schema_problems(data)
    result.problems = [problem_line(problem) for problem in found]
    try:
        recipe = decode_recipe(_without(data, [problem.path for problem in found]), source)
    except RecipeError as exc:
        if not found:  # a rule the JSON Schema cannot state: msgspec's own line is all there is
            result.problems.append(str(exc))
        return result  # a required key failed: nothing whole to check further
    later: list[str] = consistency_problems(recipe)
    result.resolved = resolve_here(recipe, later)
    result.model_dirs = locate_models(recipe, later)
    _attempt(later, check_task, recipe, base_dir if base_dir is not None else Path(source).resolve().parent)
    failed = {dotted(problem.path) for problem in found}
    result.problems += [p for p in later if not _names_failed_key(p, failed)]
    result.recipe = recipe if not result.problems else None
    return result


def validate_file(path: Path, overrides: Sequence[str] = ()) -> Validation:
    """`overrides`: `dotted.key=value` items applied to the file's data first, as `miniverl run` applies them."""
    try:
        text = text_with_overrides(read_recipe_text(path), overrides, str(path))
    except RecipeError as exc:
        return Validation(str(path), problems=[str(exc)])
    return validate_text(text, str(path))


# ---------------------------------------------------------------- the resolved configuration
def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        flat: dict[str, Any] = {}
        for key, inner in value.items():
            flat.update(_flatten(inner, _join(prefix, key)))
        return flat
    return {prefix: value}


def _is_set(data: dict, dotted: str) -> bool:
    node: Any = data
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def resolved_rows(validation: Validation) -> list[tuple[str, str, str]]:
    """(key, value, note) for every recipe key: `auto -> X` with its reason, or 'default'."""
    assert validation.recipe is not None
    rows = []
    for key, value in _flatten(recipe_to_builtins(validation.recipe)).items():
        shown = ",".join(map(str, value)) if isinstance(value, list) else ("none" if value is None else str(value))
        note = "" if _is_set(validation.data, key) else "default"
        if key in validation.resolved and value == "auto":
            resolution = validation.resolved[key]
            shown = f"auto -> {resolution.value}"
            note = resolution.reason
        elif key == "memory.budget" and value == "auto":
            note = "the device's free memory less a margin, when the run starts; `--dry-run` shows the figure"
        elif key in PLANNED_KEYS and value == "auto":  # needs the models' sizes: the dry run computes it
            note = "planned from memory.budget when the run starts; `miniverl run RECIPE --dry-run` shows the plan"
        rows.append((key, shown, note))
    return rows


def as_json(validation: Validation) -> dict:
    return {
        "recipe": validation.source,
        "valid": not validation.problems,
        "problems": validation.problems,
        "configuration": {key: {"value": value, "note": note} for key, value, note in resolved_rows(validation)}
        if validation.recipe is not None else {},
        "models": {role: str(path) for role, path in validation.model_dirs.items()},
    }


def render(console, validation: Validation) -> None:
    rows = resolved_rows(validation)
    console.print(f"{validation.source}: valid; the configuration as it resolves on this machine:", highlight=False)
    width = max(len(key) for key, _, _ in rows)
    value_width = min(max(len(value) for _, value, _ in rows), 40)
    for key, value, note in rows:
        line = f"  {key:<{width}}  {value:<{value_width}}"
        console.print(f"{line}  ({note})" if note else line.rstrip(), highlight=False, markup=False)
    for role, path in validation.model_dirs.items():
        console.print(f"  {role} model directory: {path}", highlight=False, markup=False)
