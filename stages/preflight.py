"""Preflight: resolve every `auto`, record provenance and the models' pairing verdict.

Incompatible models never get here: `models.checks` refuses them (one-line
`UserError`) when the model host is built, before any weight loads, and the
dry run calls the same checks. Preflight records what they found, and draws
the initial LoRA adapter (policy checkpoint 0) from the run seed.

reads the recipe; writes resolved.json, preflight.msgpack and checkpoint 0.
"""

from __future__ import annotations

import torch

from miniverl.engine.core import layout
from miniverl.engine.core.artifacts import ModelIdentity, Preflight, TaskIdentity, TokenizerVerdict
from miniverl.engine.core.atomic_io import sha256_file
from miniverl.engine.core.layout import Ref, StageKey
from miniverl.engine.core.device import environment, resolve_all
from miniverl.engine.models.host import ModelHost
from miniverl.engine.models.loading import read_config
from miniverl.engine.core.recipe import Recipe, recipe_to_builtins
from miniverl.engine.tasks.base import Task
from miniverl.stages.contract import Output, StageContext, artifact_output, checkpoint_outputs, checkpoint_refs, json_output

NAME = layout.PREFLIGHT


def _identity(role: str, spec, model_dir, model: torch.nn.Module) -> ModelIdentity:
    config = read_config(model_dir)
    return ModelIdentity(
        role=role,
        id=spec.id,
        revision=spec.revision,
        local_dir=str(model_dir),
        config_sha256=sha256_file(model_dir / "config.json"),
        architecture=",".join(config.get("architectures", ["unknown"])),
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        num_parameters=sum(p.numel() for p in model.parameters()),
    )


def _teacher_adapter(host: ModelHost) -> dict | None:
    """shared_backbone: the frozen teacher adapter's verified provenance (ModelHost checked it)."""
    adapter = host.teacher_adapter
    if adapter is None:
        return None
    return {"path": str(adapter.weights), "sha256": adapter.sha256, "base_id": adapter.base_id,
            "base_revision": adapter.base_revision}


def prepare(recipe: Recipe, host: ModelHost, task: Task) -> tuple[Preflight, dict[str, torch.Tensor]]:
    """`recipe` is the planned one the stages run; the record keeps the recipe as written (`host.recipe`),
    its `auto`s resolved beside it, the memory plan's with them."""
    resolved = resolve_all(recipe)
    if host.plan is not None:
        resolved.update(host.plan.resolutions)
    recipe = host.recipe
    pairing = host.pairing  # checked (and required) when the host was built, before any weight loaded
    adapter = host.initial_adapter()
    student, teacher = host.student(), host.teacher()
    heldout = task.items("heldout", recipe.task.heldout_size, recipe.task.heldout_seed)
    preflight = Preflight(
        recipe=recipe_to_builtins(recipe),
        resolved=resolved,
        environment=environment(),
        models=[
            _identity("student", recipe.models.student, host.student_dir, student),
            _identity("teacher", recipe.models.teacher, host.teacher_dir, teacher),
        ],
        tokenizer=TokenizerVerdict(
            compatible=pairing.compatible,
            student_sha256=pairing.student_sha256,
            teacher_sha256=pairing.teacher_sha256,
            tokenizer_size=pairing.tokenizer_size,
            student_vocab_rows=pairing.student_rows,
            teacher_vocab_rows=pairing.teacher_rows,
            padded_rows=max(pairing.student_rows, pairing.teacher_rows) - pairing.tokenizer_size,
            reason=pairing.reason,
        ),
        adapter={
            "kind": "lora",
            "r": recipe.models.student.lora.r,
            "alpha": recipe.models.student.lora.alpha,
            "target_modules": list(recipe.models.student.lora.target_modules),
            "trainable_parameters": sum(t.numel() for t in adapter.values()),
            "base_id": recipe.models.student.id,
            "base_revision": recipe.models.student.revision,
            "runtime": recipe.models.runtime,
            "teacher_adapter": _teacher_adapter(host),
        },
        task=TaskIdentity(name=task.name, train_items=task.capacity("train"), heldout_items=task.capacity("heldout"),
                          files={key: sha256_file(path) for key, path in sorted(task.files.items())}),
        heldout_task_ids=[t.task_id for t in heldout],
    )
    return preflight, adapter


def inputs(key: StageKey, recipe: Recipe) -> dict[str, Ref]:
    return {}


def outputs(key: StageKey, recipe: Recipe) -> list[Ref]:
    return [layout.resolved_ref(), layout.preflight_ref(), *checkpoint_refs(0)]


def run(ctx: StageContext, got: dict) -> list[Output]:
    artifact, adapter = prepare(ctx.recipe, ctx.host, ctx.task)
    resolved = {k: {"value": r.value, "reason": r.reason} for k, r in artifact.resolved.items()}
    base_config = sha256_file(ctx.host.student_dir / "config.json")
    return [json_output(layout.resolved_ref(), {"recipe": artifact.recipe, "resolved": resolved}),
            artifact_output(layout.preflight_ref(), artifact),
            *checkpoint_outputs(0, ctx.recipe, base_config, adapter, {}, {})]
