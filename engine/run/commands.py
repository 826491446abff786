"""What the commands do: create, resume, rerun a stage, inspect. The CLI only parses."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

from miniverl.engine.core import layout
from miniverl.engine.core.atomic_io import write_bytes_atomic
from miniverl.engine.core.device import resolve_all
from miniverl.engine.core.errors import ArtifactError, RecipeError, RunStateError, UserError
from miniverl.engine.models.host import ModelHost
from miniverl.engine.models.memory_estimate import free_memory, memory_refusal
from miniverl.engine.models.memory_plan import plan_for_configs, recorded_plan
from miniverl.engine.run.driver import Driver
from miniverl.engine.run.metrics import missing_package
from miniverl.engine.core.progress import Reporter
from miniverl.engine.core.recipe import Recipe, load_recipe, parse_recipe
from miniverl.engine.core.rundir import Journal, RunDir, check_run_id
from miniverl.engine.core.artifacts import Preflight, read_artifact
from miniverl.engine.core.atomic_io import sha256_file
from miniverl.engine.tasks import registry
from miniverl.engine.tasks.base import Task


def quiet_libraries() -> None:
    """transformers' deprecation chatter is not for our users."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    # bitsandbytes logs an error about optional CPU kernels at import time.
    logging.getLogger("bitsandbytes").setLevel(logging.CRITICAL)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def prepare(recipe: Recipe, recorded: dict[str, Any] | None = None) -> ModelHost:
    """Everything a user can get wrong about the models, checked before a run directory exists and before any weight loads.

    The same checks `miniverl run --dry-run` collects, here raising the first:
    the `auto` resolutions, then the models (ModelHost calls models.checks.check_models),
    then the memory plan (`host.plan`; `host.plan.applied(recipe)` is the recipe the
    stages run). `recorded`: a run's resolved.json entries, whose plan is kept.
    """
    resolved = resolve_all(recipe)
    device, dtype, optimizer = resolved["device"].value, resolved["dtype"].value, resolved["optimizer.name"].value
    host = ModelHost(recipe, device, dtype, resolved["memory.strategy"].value)
    free, source = free_memory(device) if recorded is None else (None, "")
    plan = plan_for_configs(recipe, host.configs, device, dtype, optimizer, resolved["memory.strategy"], free, source)
    if recorded is not None:
        plan = recorded_plan(recipe, recorded, plan)
    host.use_memory_strategy(plan.strategy)
    host.plan = plan
    refusal = memory_refusal(plan.applied(recipe), host.configs, device, dtype, optimizer, plan.strategy)
    if refusal is not None:
        raise RecipeError(refusal)
    missing = missing_package(recipe)
    if missing is not None:
        raise RecipeError(missing)
    return host


def copy_task_files(run: RunDir, recipe: Recipe, files: dict[str, Path]) -> None:
    """Keep the bytes the task reads inside the run: a resume must not see the user's later edits."""
    for key, source in files.items():
        write_bytes_atomic(run.root / layout.task_copy(key, str(source)), source.read_bytes())


def run_task(run: RunDir, recipe: Recipe) -> Task:
    """The task of an existing run, built from the copies it took at the start (checked against preflight's record)."""
    originals = registry.task_files(recipe.task, run.root, must_exist=False)
    files = {key: run.root / layout.task_copy(key, str(path)) for key, path in originals.items()}
    recorded = _recorded_task_files(run)
    for key, path in files.items():
        if not path.is_file() or (key in recorded and sha256_file(path) != recorded[key]):
            raise RunStateError(f"{path} is missing or changed since the run started; the run cannot be resumed")
    task = registry.build_task(recipe.task, files)
    registry.check_counts(recipe, task)
    return task


def _recorded_task_files(run: RunDir) -> dict[str, str]:
    path = run.root / layout.preflight_ref().path
    if not path.is_file():
        return {}
    try:
        return read_artifact(path, Preflight).task.files
    except Exception:  # noqa: BLE001 - a broken preflight is recomputed by the driver; nothing to compare yet
        return {}


def start_run(recipe_path: Path, run_id: str | None, runs_dir: Path, reporter: Reporter,
              overrides: Sequence[str] = ()) -> RunDir:
    """`overrides`: `dotted.key=value` items; the run's recipe.yaml is the file with them applied."""
    recipe, text = load_recipe(recipe_path, overrides)
    run_id = check_run_id(run_id or f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run = RunDir.locate(runs_dir, run_id)
    if run.root.exists() and any(run.root.iterdir()):
        if not _creation_cut_short(run):
            raise RunStateError(f"run {run_id} already exists in {runs_dir}; continue it with `miniverl resume {run_id}`")
        shutil.rmtree(run.root)  # killed before its journal existed: nothing in it was ever run
    _, files = registry.load_task(recipe, recipe_path.resolve().parent)  # a bad task file: refused before any directory
    quiet_libraries()
    host = prepare(recipe)
    created = not run.root.exists()
    try:
        with run.locked():
            write_bytes_atomic(run.root / layout.RECIPE_FILE, text.encode())
            copy_task_files(run, recipe, files)
            task = run_task(run, recipe)
            run.write_journal(Journal(run_id=run_id, overrides=list(overrides)))
            run.event("run_created", recipe=str(recipe_path))
            reporter.line(f"run {run_id} in {run.root}")
            _drive(run, host.plan.applied(recipe), host, task, reporter)
    except UserError:
        if created and not (run.root / layout.preflight_ref().path).exists():
            shutil.rmtree(run.root, ignore_errors=True)  # nothing worth keeping yet
        raise
    return run


# What a run directory holds before its journal is written (start_run writes the journal last).
_CREATION_FILES = {layout.RECIPE_FILE, layout.TASK_DIR, layout.LOCK_FILE, layout.LOCK_PID_FILE, layout.EVENTS_FILE}


def _creation_cut_short(run: RunDir) -> bool:
    """A directory `start_run` began and was killed in before writing the journal."""
    names = {path.name for path in run.root.iterdir()}
    return layout.JOURNAL_FILE not in names and names <= _CREATION_FILES


def open_run(run_id: str, runs_dir: Path) -> tuple[RunDir, Recipe]:
    run = RunDir.locate(runs_dir, run_id)
    if run.root.is_dir() and any(run.root.iterdir()) and _creation_cut_short(run):
        raise RunStateError(f"run {run_id} was stopped while it was being created, before any stage ran; "
                            f"start it again with `miniverl run RECIPE --run-id {run_id}`")
    if not run.exists():
        raise RunStateError(f"no run {run_id} in {runs_dir}; `miniverl runs` lists the runs there")
    try:
        text = (run.root / layout.RECIPE_FILE).read_text(encoding="utf-8")
    except OSError:
        raise RunStateError(f"{run.root / layout.RECIPE_FILE} is missing; the run cannot be resumed") from None
    return run, parse_recipe(text, source=str(run.root / layout.RECIPE_FILE))


def resume_run(run_id: str, runs_dir: Path, reporter: Reporter) -> RunDir:
    run, recipe = open_run(run_id, runs_dir)
    quiet_libraries()
    with run.locked():
        host = prepare(recipe, recorded_resolutions(run))
        task = run_task(run, recipe)
        journal = run.read_journal()
        done = sum(1 for record in journal.stages.values() if record.state == "done")
        pending = layout.plan_length(recipe.train.cycles) - done
        reporter.line(f"resuming {run_id}: {pending} stage(s) not done" if pending else f"run {run_id} is complete; checking its files")
        run.event("resume", pending=pending)
        _drive(run, host.plan.applied(recipe), host, task, reporter)
    return run


def recorded_resolutions(run: RunDir) -> dict[str, Any] | None:
    """resolved.json's entries (the plan preflight recorded), or None before preflight wrote it."""
    try:
        resolved = json.loads((run.root / layout.resolved_ref().path).read_text(encoding="utf-8"))["resolved"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return resolved if isinstance(resolved, dict) else None


def _drive(run: RunDir, recipe: Recipe, host: ModelHost, task: Task, reporter: Reporter) -> None:
    try:
        Driver(run, recipe, reporter, host, task).run_all()
    finally:
        task.close()


def rerun_stage(run_id: str, runs_dir: Path, stage: str, cycle: int | None, label: str | None, reporter: Reporter) -> RunDir:
    run, recipe = open_run(run_id, runs_dir)
    key = layout.key_for(stage, cycle, label, recipe.train.cycles)
    quiet_libraries()
    with run.locked():
        task = run_task(run, recipe)
        host = prepare(recipe, recorded_resolutions(run))
        driver = Driver(run, host.plan.applied(recipe), reporter, host, task)
        try:
            driver.execute(key)
        except ArtifactError as exc:
            # `stage` reruns one stage only; recomputing the inputs is resume's job.
            raise ArtifactError(f"{exc}: an input of {stage} is missing or corrupt; "
                                f"`miniverl resume {run_id}` recomputes it") from None
        finally:
            task.close()
    return run
