"""`miniverl run RECIPE --dry-run`: everything that can be checked without loading weights.

The recipe is validated (all problems at once), then the models go through the
very checks the real run makes before it loads a weight
(`engine.models.checks.check_models`), here collected instead of raised. Each
model's identity comes from its directory (config, architecture, revision,
parameter counts from the config and the safetensors headers), and the memory
each stage needs is estimated analytically against what is free here. Only the
tokenizer is loaded (to count its tokens); no weight reaches any device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from miniverl.engine.checks.dry_run_report import (
    Adapters, DryRunReport, MemoryReport, ModelReport, Shape, StageMemory, StudentAdapterReport,
    TeacherAdapterReport, TokenizerReport, render, to_json,
)
from miniverl.engine.checks.validate import validate_file
from miniverl.engine.run.metrics import missing_package
from miniverl.engine.core.atomic_io import sha256_file
from miniverl.engine.core.artifacts import Resolution
from miniverl.engine.core.recipe import Recipe
from miniverl.engine.models.checks import ROLES, CheckedModels, Refusals, check_models
from miniverl.engine.core.errors import RecipeError
from miniverl.engine.models.memory_estimate import (
    ModelShape, estimate, free_memory, impossible_plan, lora_parameters, model_shape, parameter_counts,
)
from miniverl.engine.models.memory_plan import budget_of, one_at_a_time, plan_memory

__all__ = ["DryRunReport", "dry_run", "render", "to_json"]  # the CLI's whole use of this module


# ---------------------------------------------------------------- the sections
def _revision(spec, directory: Path) -> str | None:
    """The recipe's revision, or the commit a Hugging Face cache snapshot directory is named after."""
    if spec.revision is not None:
        return spec.revision
    return directory.name if directory.parent.name == "snapshots" else None


def _shape(config: dict[str, Any] | None) -> ModelShape | None:
    """The model's dimensions, or None for a config this estimate does not know."""
    try:
        return None if config is None else model_shape(config)
    except (KeyError, TypeError, ValueError):
        return None


def model_report(role: str, spec, directory: Path, checked: CheckedModels) -> ModelReport:
    found = ModelReport(role=role, id=spec.id, revision=_revision(spec, directory), dir=str(directory),
                        config_readable=checked.configs[role] is not None)
    config, tensors = checked.configs[role], checked.tensors[role]
    if config is None:
        return found
    shape = _shape(config)
    found.config_sha256 = sha256_file(directory / "config.json")
    found.architecture = ",".join(map(str, config.get("architectures") or ["unknown"]))
    found.model_type = config.get("model_type")
    found.shape = None if shape is None else Shape(
        vocab=shape.vocab, hidden=shape.hidden, layers=shape.layers, heads=shape.heads, kv_heads=shape.kv_heads,
        head_dim=shape.head_dim, intermediate=shape.intermediate)
    found.parameters_from_config = None if shape is None else parameter_counts(shape)[0]
    found.parameters_in_checkpoint = None if tensors is None else sum(tensors.values())
    return found


def tokenizer_report(checked: CheckedModels) -> TokenizerReport:
    pairing = checked.pairing
    if pairing is None:
        return TokenizerReport(compatible=False, reason="not compared: a check before it refused (see problems)")
    padded = list(range(pairing.tokenizer_size, max(pairing.student_rows, pairing.teacher_rows)))
    return TokenizerReport(
        compatible=pairing.compatible,
        student_sha256=pairing.student_sha256,
        teacher_sha256=pairing.teacher_sha256,
        byte_identical=pairing.student_sha256 == pairing.teacher_sha256,
        tokenizer_size=pairing.tokenizer_size,
        student_vocab_rows=pairing.student_rows,
        teacher_vocab_rows=pairing.teacher_rows,
        padded_rows=f"{padded[0]}..{padded[-1]}" if padded else "none",
        padded_row_count=len(padded),
        reason=pairing.reason,
    )


def adapters_report(recipe: Recipe, dirs: dict[str, Path], checked: CheckedModels) -> Adapters:
    student = recipe.models.student
    shape = _shape(checked.configs["student"])
    return Adapters(
        student=StudentAdapterReport(
            r=student.lora.r, alpha=student.lora.alpha, target_modules=list(student.lora.target_modules),
            trainable_parameters=None if shape is None else lora_parameters(shape, student.lora.target_modules,
                                                                             student.lora.r),
            base_id=student.id, base_revision=_revision(student, dirs["student"]),
            base_config_sha256=sha256_file(dirs["student"] / "config.json"),
            origin=f"drawn at preflight from seed {recipe.seed}; every checkpoint records this base"),
        teacher=_teacher_adapter(recipe, checked),
    )


def _teacher_adapter(recipe: Recipe, checked: CheckedModels) -> TeacherAdapterReport:
    spec = recipe.models.teacher.adapter
    if spec is None:
        return TeacherAdapterReport(kind="none")
    path = Path(spec.path).expanduser()
    found = TeacherAdapterReport(kind="frozen adapter", path=str(path), base_id=spec.base_id,
                                 base_revision=spec.base_revision)
    if checked.teacher_adapter is not None:
        found.sha256 = checked.teacher_adapter.sha256
    config = (path if path.is_dir() else path.parent) / "adapter_config.json"
    try:  # shown, not judged: peft writes whatever path or id the base was loaded from
        found.adapter_config_base = json.loads(config.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        pass
    return found


def memory_report(recipe: Recipe, resolved: dict[str, Resolution], student: ModelShape,
                  teacher: ModelShape) -> tuple[MemoryReport, str | None]:
    """The memory plan (its resolutions join `resolved`) and the estimate per stage at its sizes against the
    memory free now, and the line refusing a plan that can never fit."""
    device, dtype, optimizer = resolved["models.device"].value, resolved["dtype"].value, resolved["optimizer.name"].value
    free, source = free_memory(device)
    try:
        plan = plan_memory(recipe, student, teacher, device, dtype, optimizer, resolved["memory.strategy"],
                           budget_of(recipe, free, source))
        resolved.update(plan.resolutions)
        stages, refusal = plan.stages, impossible_plan(plan.stages, device)  # the run refuses both too
    except RecipeError as exc:  # an explicit budget that cannot hold a stage: shown at one-at-a-time sizes
        stages = estimate(recipe, student, teacher, device, dtype, optimizer, resolved["memory.strategy"].value,
                          one_at_a_time(recipe))
        refusal = str(exc)
    return MemoryReport(device=device, dtype=dtype, free_bytes=free, free_source=source,
                        stages=[StageMemory(**s.as_dict()) for s in stages],
                        fits_by_estimate=None if free is None else all(s.total <= free for s in stages)), refusal


# ---------------------------------------------------------------- the dry run
def dry_run(recipe_path: Path, overrides: Sequence[str] = ()) -> DryRunReport:
    validation = validate_file(recipe_path, overrides)
    if validation.problems:  # the same lines `miniverl validate` prints; nothing further can be checked
        return DryRunReport(recipe=str(recipe_path), resolved={}, problems=validation.problems)
    recipe, resolved, dirs = validation.recipe, validation.resolved, validation.model_dirs
    refusals = Refusals(collect=True)
    checked = check_models(recipe, dirs, refusals)
    missing = missing_package(recipe)  # a sink whose package is absent: `run` refuses it too
    if missing is not None:
        refusals.messages.append(missing)
    report = DryRunReport(
        recipe=str(recipe_path),
        resolved=resolved,
        models=[model_report(role, getattr(recipe.models, role), dirs[role], checked) for role in ROLES],
        tokenizer=tokenizer_report(checked),
        problems=refusals.messages,
    )
    if any(config is None for config in checked.configs.values()):
        return report
    report.adapters = adapters_report(recipe, dirs, checked)
    student, teacher = _shape(checked.configs["student"]), _shape(checked.configs["teacher"])
    if student is None or teacher is None:
        report.memory_note = "no memory estimate: a config lacks the dense-transformer sizes it is computed from"
    else:
        report.memory, refusal = memory_report(recipe, resolved, student, teacher)
        if refusal is not None:
            report.problems.append(refusal)
    return report
