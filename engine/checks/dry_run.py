"""`miniverl run RECIPE --dry-run`: everything that can be checked without loading weights.

The recipe is validated (all problems at once), then each model's identity is
read from its directory (config, architecture, revision, parameter counts from
the config and the safetensors headers), the tokenizers are compared byte for
byte, the adapters' provenance is checked against their bases, and the memory
each stage needs is estimated analytically against what is free here. Only the
tokenizer is loaded (to count its tokens); no weight reaches any device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miniverl.engine.core.errors import UserError
from miniverl.engine.models.memory_estimate import (
    checkpoint_tensors, estimate, free_memory, lora_parameters, model_shape, parameter_counts,
)
from miniverl.engine.models.loading import check_pairing, file_sha256, load_tokenizer, read_config
from miniverl.engine.core.recipe import Recipe
from miniverl.engine.checks.validate import validate_file

NOTE = ("an estimate from configs and budgets, not a measurement: allocator fragmentation, kernels and "
        "library versions differ, so only a real run proves the fit")


def _revision(spec, directory: Path) -> str | None:
    """The recipe's revision, or the commit a Hugging Face cache snapshot directory is named after."""
    if spec.revision is not None:
        return spec.revision
    return directory.name if directory.parent.name == "snapshots" else None


def shape_of(directory: Path):
    """The model's dimensions from its config, or None for a config this estimate does not know."""
    try:
        return model_shape(read_config(directory))
    except (UserError, KeyError, TypeError, ValueError):
        return None


def identity(role: str, spec, directory: Path, problems: list[str]) -> dict[str, Any]:
    found: dict[str, Any] = {"role": role, "id": spec.id, "revision": _revision(spec, directory), "dir": str(directory)}
    try:
        config = read_config(directory)
    except UserError as exc:
        problems.append(f"models.{role}: {exc}")
        return {**found, "config_readable": False}
    architectures = config.get("architectures") or ["unknown"]
    if not any(str(a).endswith("ForCausalLM") for a in architectures):
        problems.append(f"models.{role}: architecture {','.join(architectures)} is not a causal LM (…ForCausalLM)")
    shape, tensors = shape_of(directory), checkpoint_tensors(directory)
    found.update({
        "config_readable": True,
        "config_sha256": file_sha256(directory / "config.json"),
        "architecture": ",".join(architectures),
        "model_type": config.get("model_type"),
        "shape": None if shape is None else {
            "vocab": shape.vocab, "hidden": shape.hidden, "layers": shape.layers, "heads": shape.heads,
            "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "intermediate": shape.intermediate},
        "parameters_from_config": None if shape is None else parameter_counts(shape)[0],
        "parameters_in_checkpoint": sum(tensors.values()) if tensors is not None else None,
    })
    if tensors is None:
        problems.append(f"models.{role}: no *.safetensors weights in {directory}")
    return found


def tokenizer_check(student_dir: Path, teacher_dir: Path, problems: list[str]) -> dict[str, Any]:
    try:
        size = len(load_tokenizer(student_dir))
        pairing = check_pairing(student_dir, teacher_dir, size)
    except (UserError, OSError, ValueError) as exc:
        problems.append(f"tokenizer: {exc}")
        return {"compatible": False, "reason": str(exc)}
    rows = max(pairing.student_rows, pairing.teacher_rows)
    padded = list(range(size, rows))
    if not pairing.compatible:
        problems.append(f"student and teacher are incompatible: {pairing.reason}")
    return {
        "compatible": pairing.compatible,
        "student_sha256": pairing.student_sha256,
        "teacher_sha256": pairing.teacher_sha256,
        "byte_identical": pairing.student_sha256 == pairing.teacher_sha256,
        "tokenizer_size": size,
        "student_vocab_rows": pairing.student_rows,
        "teacher_vocab_rows": pairing.teacher_rows,
        "padded_rows": f"{padded[0]}..{padded[-1]}" if padded else "none",
        "padded_row_count": len(padded),
        "reason": pairing.reason,
    }


def _module_names(tensors: dict[str, int] | None, shape) -> set[str] | None:
    """Module names of the checkpoint's weights (`...q_proj.weight` -> `q_proj`), else the config's."""
    if tensors is not None:
        return {name.split(".")[-2] for name in tensors if name.endswith(".weight") and name.count(".") >= 2}
    return None if shape is None else set(shape.linear_shapes())


def adapter_check(recipe: Recipe, dirs: dict[str, Path], problems: list[str]) -> dict[str, Any]:
    student = recipe.models.student
    shape = shape_of(dirs["student"])
    known = _module_names(checkpoint_tensors(dirs["student"]), shape)
    missing = [m for m in student.lora.target_modules if known is not None and m not in known]
    if missing:
        problems.append(f"recipe key models.student.lora.target_modules: {', '.join(missing)} match no module of "
                        f"{student.id}; its projections are {', '.join(sorted(m for m in known if m.endswith('proj')))}")
    report: dict[str, Any] = {"student": {
        "kind": "lora", "r": student.lora.r, "alpha": student.lora.alpha, "target_modules": list(student.lora.target_modules),
        "trainable_parameters": None if shape is None else lora_parameters(shape, student.lora.target_modules, student.lora.r),
        "base_id": student.id, "base_revision": _revision(student, dirs["student"]),
        "base_config_sha256": file_sha256(dirs["student"] / "config.json"),
        "origin": f"drawn at preflight from seed {recipe.seed}; every checkpoint records this base",
    }}
    teacher = recipe.models.teacher
    report["teacher"] = _teacher_adapter(recipe, problems) if teacher.adapter is not None else {"kind": "none"}
    return report


def _teacher_adapter(recipe: Recipe, problems: list[str]) -> dict[str, Any]:
    spec = recipe.models.teacher.adapter
    path = Path(spec.path).expanduser()
    found: dict[str, Any] = {"kind": "frozen adapter", "path": str(path), "base_id": spec.base_id,
                             "base_revision": spec.base_revision}
    weights = path / "adapter_model.safetensors" if path.is_dir() else path
    if not weights.is_file():
        problems.append(f"recipe key models.teacher.adapter.path: {weights} does not exist")
        return found
    found["sha256"] = file_sha256(weights)
    if spec.sha256 is not None and spec.sha256 != found["sha256"]:
        problems.append(f"recipe key models.teacher.adapter.sha256: the file's sha256 is {found['sha256']}, "
                        "not the recorded one; the adapter was replaced")
    base = (recipe.models.teacher.id, recipe.models.teacher.revision)
    if (spec.base_id, spec.base_revision) != base:
        problems.append(f"recipe key models.teacher.adapter.base_id: the adapter was trained on "
                        f"{spec.base_id}@{spec.base_revision}, the teacher base is {base[0]}@{base[1]}")
    config = path / "adapter_config.json" if path.is_dir() else None
    if config is not None and config.is_file():
        import json

        trained_on = json.loads(config.read_text()).get("base_model_name_or_path")
        found["adapter_config_base"] = trained_on
        if trained_on and trained_on != spec.base_id:
            problems.append(f"models.teacher.adapter: adapter_config.json names base {trained_on}, "
                            f"the recipe says {spec.base_id}")
    return found


def dry_run(recipe_path: Path) -> dict[str, Any]:
    validation = validate_file(recipe_path)
    if validation.problems:  # the same lines `miniverl validate` prints; nothing further can be checked
        return {"recipe": str(recipe_path), "resolved": {}, "problems": validation.problems, "note": NOTE}
    recipe, resolved, dirs = validation.recipe, validation.resolved, validation.model_dirs
    problems: list[str] = []
    models = [identity(role, getattr(recipe.models, role), dirs[role], problems) for role in ("student", "teacher")]
    report: dict[str, Any] = {
        "recipe": str(recipe_path),
        "resolved": {key: {"value": r.value, "reason": r.reason} for key, r in resolved.items()},
        "models": models,
        "tokenizer": tokenizer_check(dirs["student"], dirs["teacher"], problems),
    }
    if not all(m["config_readable"] for m in models):
        return {**report, "problems": problems, "note": NOTE}
    report["adapters"] = adapter_check(recipe, dirs, problems)
    student, teacher = shape_of(dirs["student"]), shape_of(dirs["teacher"])
    if student is None or teacher is None:
        report["memory_note"] = "no memory estimate: a config lacks the dense-transformer sizes it is computed from"
    else:
        device = resolved["models.device"].value
        stages = estimate(recipe, student, teacher, device, resolved["dtype"].value, resolved["optimizer.name"].value,
                          resolved["memory.strategy"].value)
        free, source = free_memory(device)
        report["memory"] = {
            "device": device, "dtype": resolved["dtype"].value, "free_bytes": free, "free_source": source,
            "stages": [s.as_dict() for s in stages],
            "fits_by_estimate": None if free is None else all(s.total <= free for s in stages),
        }
    report["problems"] = problems
    report["note"] = NOTE
    return report


# ---------------------------------------------------------------- rendering
def _mib(n: int | None) -> str:
    if n is None:
        return "unknown"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _memory_table(mem: dict[str, Any]):
    """One unit for the whole table (GiB once any stage reaches 1 GiB), so it fits 80 columns."""
    from rich import box
    from rich.table import Table

    gib = max(s["total"] for s in mem["stages"]) >= 2**30
    unit, scale = ("GiB", 2**30) if gib else ("MiB", 2**20)
    table = Table(title=f"memory estimate in {unit} on {mem['device']} in {mem['dtype']}", title_justify="left",
                  box=box.SIMPLE_HEAD)
    columns = (("weights", "weights"), ("adapter", "adapter"), ("kv_cache", "KV"), ("activations", "activ."),
               ("chunk_tensors", "chunk"), ("runtime", "runtime"), ("total", "total"))
    table.add_column("stage", no_wrap=True)
    for _, header in columns:
        table.add_column(header, justify="right", no_wrap=True)
    for stage in mem["stages"]:
        table.add_row(stage["stage"], *(f"{stage[key] / scale:.1f}" for key, _ in columns))
    return table


def _count(n: int | None) -> str:
    return "?" if n is None else f"{n:,}"


def _model_line(m: dict[str, Any]) -> str:
    counted, from_config = m["parameters_in_checkpoint"], m["parameters_from_config"]
    if from_config is None:
        sizes = f"{_count(counted)} parameters in the checkpoint (sizes not read from this config)"
    else:
        check = "" if counted is None else (" = checkpoint" if counted == from_config else f"; checkpoint holds {counted:,}")
        sizes = (f"{m['shape']['layers']} layers x {m['shape']['hidden']}, "
                 f"{from_config:,} parameters from config{check}")
    return (f"  {m['role']:<8} {m['id']} @ {m['revision'] or 'unpinned'}: {m['architecture']}, config readable "
            f"(sha256 {m['config_sha256'][:12]}), {sizes}")


def render(console, report: dict[str, Any]) -> None:
    def say(text: str) -> None:
        console.print(text, highlight=False, markup=False)

    say(f"dry run of {report['recipe']}: no weights are loaded and nothing is trained")
    for key, r in report["resolved"].items():
        say(f"  {key:<16} {r['value']:<17} ({r['reason']})")
    if "models" not in report:
        return
    say("models")
    for m in report["models"]:
        if not m["config_readable"]:
            say(f"  {m['role']:<8} {m['id']}: config.json unreadable")
            continue
        say(_model_line(m))
        say(f"           {m['dir']}")
    t = report["tokenizer"]
    if "tokenizer_size" in t:
        same = "byte-identical tokenizer files" if t["byte_identical"] else "tokenizer files DIFFER"
        say(f"tokenizer  {same} (sha256 {t['student_sha256'][:12]}), {t['tokenizer_size']} tokens; output rows: "
            f"student {t['student_vocab_rows']}, teacher {t['teacher_vocab_rows']}")
        if t["padded_row_count"]:
            say(f"           padded rows {t['padded_rows']} ({t['padded_row_count']}) lie beyond the tokenizer: "
                "masked out of every loss and never sampled")
    if "adapters" in report:
        s, te = report["adapters"]["student"], report["adapters"]["teacher"]
        say(f"adapter    student: LoRA r={s['r']} alpha={s['alpha']} on {','.join(s['target_modules'])}, "
            f"{_count(s['trainable_parameters'])} trainable parameters over base {s['base_id']} @ "
            f"{s['base_revision'] or 'unpinned'} ({s['origin']})")
        say(f"           teacher: {te['kind']}" + (f" {te['path']} on {te['base_id']}" if te["kind"] != "none" else ""))
    if "memory_note" in report:
        say(report["memory_note"])
    if "memory" in report:
        mem = report["memory"]
        console.print(_memory_table(mem))
        say(f"free here: {_mib(mem['free_bytes'])} ({mem['free_source']})")
        largest = max(mem["stages"], key=lambda s: s["total"])
        if mem["fits_by_estimate"] is None:
            say(f"largest stage {largest['stage']} needs ~{_mib(largest['total'])}; free memory is unknown here")
        else:
            verdict = "fits" if mem["fits_by_estimate"] else "does NOT fit"
            say(f"largest stage {largest['stage']} needs ~{_mib(largest['total'])} of {_mib(mem['free_bytes'])} free: "
                f"{verdict} by this estimate")
    say(f"note: {report['note']}")
