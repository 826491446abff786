"""`miniverl eval`: the strict held-out verifier for any adapter of the recipe's student, or the bare base.

The same function as the verify stage (`stages.verify.evaluate`: greedy
decoding of the held-out split, the task's strict judge), on the recipe's
device and batch size, so evaluating a run's exported adapter reproduces the
run's own figures exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from miniverl.engine.core.artifacts import VerifyReport
from miniverl.engine.core.errors import IncompatibleModelsError, UserError
from miniverl.engine.core.progress import Reporter
from miniverl.engine.core.recipe import MAX_HELDOUT, Recipe, load_recipe
from miniverl.engine.core.rundir import RunDir
from miniverl.engine.export.peft_dir import read_adapter_dir
from miniverl.engine.export.run_checkpoint import read_checkpoint
from miniverl.engine.models.loading import locate_model
from miniverl.engine.run.commands import open_run, prepare, quiet_libraries, run_task
from miniverl.engine.tasks import registry
from miniverl.engine.tasks.base import Task
from miniverl.stages.verify import evaluate as verify

BASE = "base"


@dataclass(frozen=True)
class Evaluation:
    target: str  # the recipe file or run id
    policy: str  # "base", the adapter directory, or "run ID step K"
    report: VerifyReport


def _with_student_lora(recipe: Recipe, lora) -> Recipe:
    student = msgspec.structs.replace(recipe.models.student, lora=lora)
    return msgspec.structs.replace(recipe, models=msgspec.structs.replace(recipe.models, student=student))


def _with_heldout(recipe: Recipe, n: int) -> Recipe:
    if not 1 <= n <= MAX_HELDOUT:
        raise UserError(f"--n {n}: evaluate between 1 and {MAX_HELDOUT:,} held-out tasks")
    return msgspec.structs.replace(recipe, task=msgspec.structs.replace(recipe.task, heldout_size=n))


def _open(target: str, runs_dir: Path) -> tuple[Recipe, Task, RunDir | None]:
    path = Path(target)
    if path.is_file() or path.suffix in (".yaml", ".yml"):
        recipe, _ = load_recipe(path)
        task, _ = registry.load_task(recipe, path.resolve().parent)
        return recipe, task, None
    if not (runs_dir / target).is_dir():
        raise UserError(f"{target} is neither a recipe file nor a run in {runs_dir}; pass a recipe .yaml or a run id "
                        f"(`miniverl runs` lists them)")
    run, recipe = open_run(target, runs_dir)
    return recipe, run_task(run, recipe), run


def evaluate_policy(target: str, runs_dir: Path, adapter: Path | None, base: bool, n: int | None,
                    step: int | None, reporter: Reporter) -> Evaluation:
    if adapter is not None and base:
        raise UserError("--adapter and --base exclude each other: evaluate one policy at a time")
    if step is not None and (adapter is not None or base):
        raise UserError("--step picks a checkpoint of a run; it does not go with --adapter or --base")
    recipe, task, run = _open(target, runs_dir)
    try:
        if run is None and adapter is None and not base:
            raise UserError(f"eval {target} needs --adapter DIR or --base: a recipe has no trained adapter "
                            f"(give a run id to evaluate a run's)")
        if run is None and step is not None:
            raise UserError("--step picks a checkpoint of a run; give a run id, not a recipe")
        if n is not None:
            recipe = _with_heldout(recipe, n)
            registry.check_counts(recipe, task)
        state: dict[str, torch.Tensor] | None = None
        if adapter is not None:
            s = recipe.models.student
            found = read_adapter_dir(adapter, s, locate_model("student", s.id, s.revision, s.path))
            recipe, state, digest, policy = _with_student_lora(recipe, found.lora), found.state, found.sha256, str(adapter)
        elif not base:
            source = read_checkpoint(run, recipe, step)
            state, digest = source.adapter, source.checkpoint.adapter_sha256
            policy = f"run {target} step {source.step}"
        quiet_libraries()
        host = prepare(recipe)
        if state is None:
            state, digest, policy = host.initial_adapter(), BASE, BASE  # LoRA B is zero: exactly the base's outputs
        try:
            host.student(state)
        except (IncompatibleModelsError, RuntimeError) as exc:
            first = str(exc).strip().splitlines()[0][:200]
            raise IncompatibleModelsError(f"{policy} does not fit the student {recipe.models.student.id} "
                                          f"({first})") from None
        report = verify(recipe, host, task, state, digest, "eval", reporter)
    finally:
        task.close()
    return Evaluation(target, policy, report)
