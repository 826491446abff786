"""`miniverl validate`: every problem of a recipe at once, then what it resolves to here.

msgspec stops at the first error, which makes a user fix a recipe one key per
attempt. So the YAML is walked here against the recipe's Struct types, one key
at a time: a nested section is walked field by field and every leaf value is
converted on its own, which collects every unknown key, wrong type and
out-of-range value. Keys that failed are dropped (their defaults stand in) so
that the rules spanning several keys, the `auto` resolutions and the model
locations can still be checked in the same pass; a later problem that names a
key which already failed is not repeated.
"""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from miniverl.engine.core.device import (
    Resolved, check_quantization, resolve_device, resolve_dtype, resolve_memory_strategy, resolve_optimizer,
)
from miniverl.engine.core.errors import RecipeError, UserError
from miniverl.engine.core.recipe import Recipe, consistency_problems, load_recipe_data, read_recipe_text, recipe_to_builtins

_AT_RE = re.compile(r"\s*-\s*at\s*`\$(?P<path>[^`]*)`\s*$")


@dataclass
class Validation:
    source: str
    problems: list[str] = field(default_factory=list)
    recipe: Recipe | None = None
    data: dict = field(default_factory=dict)
    resolved: dict[str, Resolved] = field(default_factory=dict)  # recipe key -> value and reason
    model_dirs: dict[str, Path] = field(default_factory=dict)  # role -> local directory


# ---------------------------------------------------------------- schema walk
def _struct_in(annotation: Any) -> type[msgspec.Struct] | None:
    """The Struct class of `S` or `S | None`, else None."""
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        structs = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, msgspec.Struct)]
        return structs[0] if len(structs) == 1 else None
    return None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else str(key)


def _walk(data: Any, struct: type[msgspec.Struct], path: str, problems: list[tuple[str, str]]) -> dict | None:
    """Check `data` against `struct`, appending (key path, problem); return the keys that passed."""
    if not isinstance(data, dict):
        problems.append((path, f"expected a mapping of keys, got {type(data).__name__}"))
        return None
    fields = {f.name: f for f in msgspec.structs.fields(struct)}
    for key in data:
        if key not in fields:
            problems.append((_join(path, key), "unknown key (README.md lists the recipe keys)"))
    kept: dict[str, Any] = {}
    for name, info in fields.items():
        key_path = _join(path, name)
        if name not in data:
            if info.required:
                problems.append((key_path, "missing required key"))
            continue
        value = data[name]
        nested = _struct_in(info.type)
        if nested is not None and isinstance(value, dict):
            inner = _walk(value, nested, key_path, problems)
            if inner is not None:
                kept[name] = inner
            continue
        try:
            msgspec.convert(value, info.type, strict=True)
        except msgspec.ValidationError as exc:
            message = str(exc)
            at = _AT_RE.search(message)
            if at:  # inside a list: `$[1]` -> `.1`
                key_path += re.sub(r"\[(\d+)\]", r".\1", at.group("path"))
                message = message[: at.start()]
            problems.append((key_path, message.strip()))
            continue
        kept[name] = value
    return kept


def schema_problems(data: dict) -> tuple[list[tuple[str, str]], dict | None]:
    problems: list[tuple[str, str]] = []
    kept = _walk(data, Recipe, "", problems)
    return problems, kept


# ---------------------------------------------------------------- checks that need a whole recipe
def _attempt(problems: list[str], check, *args):
    try:
        return check(*args)
    except UserError as exc:
        problems.append(str(exc))
        return None


def resolve_here(recipe: Recipe, problems: list[str]) -> dict[str, Resolved]:
    """Each `auto` key's value on this machine and why, collecting every refusal."""
    resolved: dict[str, Resolved] = {}
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


def validate_text(text: str, source: str) -> Validation:
    result = Validation(source)
    try:
        data = load_recipe_data(text, source)
    except RecipeError as exc:
        result.problems.append(str(exc))
        return result
    result.data = data
    walked, kept = schema_problems(data)
    result.problems = [f"recipe key {path or '(top level)'}: {problem}" for path, problem in walked]
    try:
        recipe = msgspec.convert(kept, Recipe, strict=True)
    except msgspec.ValidationError:
        return result  # a required section failed: nothing whole to check further
    later: list[str] = consistency_problems(recipe)
    result.resolved = resolve_here(recipe, later)
    result.model_dirs = locate_models(recipe, later)
    failed = {path for path, _ in walked}
    result.problems += [p for p in later if not _names_failed_key(p, failed)]
    result.recipe = recipe if not result.problems else None
    return result


def validate_file(path: Path) -> Validation:
    try:
        text = read_recipe_text(path)
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
