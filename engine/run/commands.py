"""What the commands do: create, resume, rerun a stage, inspect. The CLI only parses."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from miniverl.engine.core.atomic_io import write_bytes_atomic
from miniverl.engine.core.device import resolve_all
from miniverl.engine.core.errors import ArtifactError, RunStateError, UserError
from miniverl.engine.models.host import ModelHost
from miniverl.engine.models.loading import check_pairing, require_pairing
from miniverl.engine.run.driver import STAGE_NAMES, Pipeline, StageKey, plan
from miniverl.engine.core.progress import Reporter
from miniverl.engine.core.recipe import Recipe, load_recipe, parse_recipe
from miniverl.engine.core.rundir import Journal, RunDir, check_run_id


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


def prepare(recipe: Recipe) -> ModelHost:
    """Everything a user can get wrong, checked before a run directory exists."""
    resolved = resolve_all(recipe)
    host = ModelHost(recipe, resolved["device"].value, resolved["dtype"].value, resolved["memory.strategy"].value)
    require_pairing(check_pairing(host.student_dir, host.teacher_dir, host.vocab_limit))
    return host


def start_run(recipe_path: Path, run_id: str | None, runs_dir: Path, reporter: Reporter) -> RunDir:
    recipe, text = load_recipe(recipe_path)
    run_id = check_run_id(run_id or f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run = RunDir.locate(runs_dir, run_id)
    if run.root.exists() and any(run.root.iterdir()):
        raise RunStateError(f"run {run_id} already exists in {runs_dir}; continue it with `miniverl resume {run_id}`")
    quiet_libraries()
    host = prepare(recipe)
    created = not run.root.exists()
    try:
        with run.locked():
            write_bytes_atomic(run.root / "recipe.yaml", text.encode())
            run.write_journal(Journal(run_id=run_id))
            run.event("run_created", recipe=str(recipe_path))
            reporter.line(f"run {run_id} in {run.root}")
            _drive(run, recipe, host, reporter)
    except UserError:
        if created and not (run.root / "preflight.msgpack").exists():
            shutil.rmtree(run.root, ignore_errors=True)  # nothing worth keeping yet
        raise
    return run


def open_run(run_id: str, runs_dir: Path) -> tuple[RunDir, Recipe]:
    run = RunDir.locate(runs_dir, run_id)
    if not run.exists():
        raise RunStateError(f"no run {run_id} in {runs_dir}; `miniverl runs` lists the runs there")
    try:
        text = (run.root / "recipe.yaml").read_text(encoding="utf-8")
    except OSError:
        raise RunStateError(f"{run.root / 'recipe.yaml'} is missing; the run cannot be resumed") from None
    return run, parse_recipe(text, source=str(run.root / "recipe.yaml"))


def resume_run(run_id: str, runs_dir: Path, reporter: Reporter) -> RunDir:
    run, recipe = open_run(run_id, runs_dir)
    quiet_libraries()
    with run.locked():
        host = prepare(recipe)
        journal = run.read_journal()
        pending = [k.id for k in plan(recipe) if journal.stages.get(k.id, None) is None or journal.stages[k.id].state != "done"]
        reporter.line(f"resuming {run_id}: {len(pending)} stage(s) not done" if pending else f"run {run_id} is complete; checking its files")
        run.event("resume", pending=len(pending))
        _drive(run, recipe, host, reporter)
    return run


def _drive(run: RunDir, recipe: Recipe, host: ModelHost, reporter: Reporter) -> None:
    Pipeline(run, recipe, reporter, host).run_all()


def rerun_stage(run_id: str, runs_dir: Path, stage: str, cycle: int | None, label: str | None, reporter: Reporter) -> RunDir:
    if stage not in STAGE_NAMES:
        raise UserError(f"unknown stage {stage!r}; stages are: {', '.join(STAGE_NAMES)}")
    run, recipe = open_run(run_id, runs_dir)
    key = find_key(recipe, stage, cycle, label)
    quiet_libraries()
    with run.locked():
        pipeline = Pipeline(run, recipe, reporter, prepare(recipe))
        try:
            pipeline.execute(key)
        except ArtifactError as exc:
            # `stage` reruns one stage only; recomputing the inputs is resume's job.
            raise ArtifactError(f"{exc}: an input of {stage} is missing or corrupt; "
                                f"`miniverl resume {run_id}` recomputes it") from None
    return run


def find_key(recipe: Recipe, stage: str, cycle: int | None, label: str | None) -> StageKey:
    cycled = stage in ("rollout", "teacher_score", "gradient", "optimizer_step")
    if cycled and cycle is None:
        raise UserError(f"stage {stage} needs --cycle K (0..{recipe.train.cycles - 1})")
    if cycled and not 0 <= cycle < recipe.train.cycles:
        raise UserError(f"--cycle {cycle} is out of range: this run has cycles 0..{recipe.train.cycles - 1}")
    if stage == "verify":
        label = label or "final"
        if label not in ("baseline", "final"):
            raise UserError("verify takes --label baseline or --label final")
    return StageKey(stage, cycle if cycled else None, label if stage == "verify" else None)


def read_manifest(run: RunDir) -> dict | None:
    try:
        return json.loads((run.root / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
