"""The on-disk contract of a run: stage ids, the plan, and where every artifact lives.

This is the only module that spells a stage id or an artifact path; the
driver, the stages, `inspect`, `runs` and `report` all ask it. A `Ref` names
one artifact by its producer stage, its path in the run directory and its
type, so a reader can check the bytes against the hash the producer's journal
entry recorded.

    preflight -> verify@baseline -> [c%06d/rollout -> teacher_score -> gradient -> optimizer_step] x N
              -> verify@final -> manifest

The plan is computed from the number of cycles, never materialised: a key's
position in it is arithmetic (`StageKey.order`).
"""

from __future__ import annotations

from pathlib import PurePosixPath

from dataclasses import dataclass
from typing import Any, Iterator

from miniverl.engine.core.artifacts import Checkpoint, Gradient, Preflight, Rollout, TeacherScore, VerifyReport
from miniverl.engine.core.errors import UserError

PREFLIGHT, ROLLOUT, TEACHER_SCORE, GRADIENT, OPTIMIZER_STEP, VERIFY, MANIFEST = (
    "preflight", "rollout", "teacher_score", "gradient", "optimizer_step", "verify", "manifest")
STAGE_NAMES = (PREFLIGHT, ROLLOUT, TEACHER_SCORE, GRADIENT, OPTIMIZER_STEP, VERIFY, MANIFEST)
CYCLE_STAGES = (ROLLOUT, TEACHER_SCORE, GRADIENT, OPTIMIZER_STEP)
BASELINE, FINAL = "baseline", "final"
VERIFY_LABELS = (BASELINE, FINAL)

# Files of the run directory itself (not stage outputs).
RECIPE_FILE = "recipe.yaml"
JOURNAL_FILE = "journal.msgpack"  # the journal's snapshot (a run exists once it does)
JOURNAL_LOG = "journal.log"  # the updates since that snapshot, appended
EVENTS_FILE = "events.jsonl"
LOCK_FILE = "lock"
LOCK_PID_FILE = "lock.pid"
ERRORS_LOG = "errors.log"
RESOLVED_FILE = "resolved.json"
MANIFEST_FILE = "manifest.json"
TASK_DIR = "task"  # copies of the files the task reads (an items file, a tools module), taken at the start


def task_copy(key: str, original: str) -> str:
    """Where the run keeps its copy of the file recipe key `task.<key>` names: `task/path.jsonl`, `task/tools.py`."""
    suffix = "".join(c for c in PurePosixPath(original).suffix if c.isalnum() or c == ".")
    return f"{TASK_DIR}/{key}{suffix}"


@dataclass(frozen=True)
class StageKey:
    name: str
    cycle: int | None = None  # the per-cycle stages
    label: str | None = None  # verify: baseline | final

    @property
    def id(self) -> str:
        if self.cycle is not None:
            return f"c{self.cycle:06d}/{self.name}"
        return f"{self.name}@{self.label}" if self.label else self.name

    @property
    def order(self) -> tuple[int, int, int]:
        """Sort key in plan order: preflight, verify@baseline, the cycles, verify@final, manifest."""
        if self.cycle is not None:
            return 2, self.cycle, CYCLE_STAGES.index(self.name)
        if self.name == PREFLIGHT:
            return 0, 0, 0
        if self.name == VERIFY:
            return (1, 0, 0) if self.label == BASELINE else (3, 0, 0)
        return 4, 0, 0

    @staticmethod
    def parse(stage_id: str) -> "StageKey":
        if "/" in stage_id:
            cycle, name = stage_id.split("/", 1)
            return StageKey(name, int(cycle.lstrip("c") or 0))
        name, _, label = stage_id.partition("@")
        return StageKey(name, None, label or None)


def stage_order(stage_id: str) -> tuple[int, int, int]:
    """Plan order of a journal key (unknown names sort last)."""
    try:
        return StageKey.parse(stage_id).order
    except ValueError:
        return 9, 0, 0


def plan(cycles: int) -> Iterator[StageKey]:
    """Every stage of a run with `cycles` cycles, in the order they run."""
    yield StageKey(PREFLIGHT)
    yield StageKey(VERIFY, label=BASELINE)
    for cycle in range(cycles):
        for name in CYCLE_STAGES:
            yield StageKey(name, cycle)
    yield StageKey(VERIFY, label=FINAL)
    yield StageKey(MANIFEST)


def plan_length(cycles: int) -> int:
    return 4 + len(CYCLE_STAGES) * cycles


def key_for(stage: str, cycle: int | None, label: str | None, cycles: int) -> StageKey:
    """The key a user names on the command line (`stage RUN gradient --cycle 3`)."""
    if stage not in STAGE_NAMES:
        raise UserError(f"unknown stage {stage!r}; stages are: {', '.join(STAGE_NAMES)}")
    if stage in CYCLE_STAGES:
        if cycle is None:
            raise UserError(f"stage {stage} needs --cycle K (0..{cycles - 1})")
        if not 0 <= cycle < cycles:
            raise UserError(f"--cycle {cycle} is out of range: this run has cycles 0..{cycles - 1}")
        return StageKey(stage, cycle)
    if stage == VERIFY:
        label = label or FINAL
        if label not in VERIFY_LABELS:
            raise UserError("verify takes --label baseline or --label final")
        return StageKey(stage, label=label)
    return StageKey(stage)


# ---------------------------------------------------------------- artifact references
@dataclass(frozen=True)
class Ref:
    """One artifact: who writes it, where, and what it holds.

    `kind` is the msgspec Struct an artifact file decodes to, `TENSORS` for a
    safetensors file, `JSON` for a JSON document. `optional`: the producer may
    not write it (checkpoint 0 has no optimizer state); a reader then gets None.
    """

    producer: StageKey
    path: str
    kind: Any
    optional: bool = False


TENSORS = "tensors"
JSON = "json"


def cycle_dir(cycle: int) -> str:
    return f"cycles/{cycle:06d}"


def checkpoint_dir(step: int) -> str:
    return f"checkpoints/{step:06d}"


def checkpoint_producer(step: int) -> StageKey:
    """Checkpoint 0 is drawn by preflight; checkpoint k+1 is written by cycle k's optimizer step."""
    return StageKey(PREFLIGHT) if step == 0 else StageKey(OPTIMIZER_STEP, step - 1)


def preflight_ref() -> Ref:
    return Ref(StageKey(PREFLIGHT), "preflight.msgpack", Preflight)


def resolved_ref() -> Ref:
    return Ref(StageKey(PREFLIGHT), RESOLVED_FILE, JSON)


def checkpoint_ref(step: int) -> Ref:
    return Ref(checkpoint_producer(step), f"{checkpoint_dir(step)}/checkpoint.msgpack", Checkpoint)


def adapter_ref(step: int) -> Ref:
    return Ref(checkpoint_producer(step), f"{checkpoint_dir(step)}/adapter.safetensors", TENSORS)


def optimizer_ref(step: int) -> Ref:
    return Ref(checkpoint_producer(step), f"{checkpoint_dir(step)}/optimizer.safetensors", TENSORS, optional=True)


def rollout_ref(cycle: int) -> Ref:
    return Ref(StageKey(ROLLOUT, cycle), f"{cycle_dir(cycle)}/rollout.msgpack", Rollout)


def teacher_score_ref(cycle: int) -> Ref:
    return Ref(StageKey(TEACHER_SCORE, cycle), f"{cycle_dir(cycle)}/teacher_score.msgpack", TeacherScore)


def teacher_tensors_ref(cycle: int) -> Ref:
    return Ref(StageKey(TEACHER_SCORE, cycle), f"{cycle_dir(cycle)}/teacher_score.safetensors", TENSORS)


def gradient_ref(cycle: int) -> Ref:
    return Ref(StageKey(GRADIENT, cycle), f"{cycle_dir(cycle)}/gradient.msgpack", Gradient)


def gradient_tensors_ref(cycle: int) -> Ref:
    return Ref(StageKey(GRADIENT, cycle), f"{cycle_dir(cycle)}/gradient.safetensors", TENSORS)


def verify_ref(label: str) -> Ref:
    name = "baseline" if label == BASELINE else "report"
    return Ref(StageKey(VERIFY, label=label), f"verify/{name}.msgpack", VerifyReport)


def manifest_ref() -> Ref:
    return Ref(StageKey(MANIFEST), MANIFEST_FILE, JSON)


def verified_step(label: str, cycles: int) -> int:
    """The policy checkpoint a verify reads: the initial adapter, or the last one."""
    return 0 if label == BASELINE else cycles


def shown_artifact(stage: str, cycle: int | None, label: str | None = None) -> Ref:
    """The artifact `inspect RUN STAGE` shows for a stage."""
    if stage in CYCLE_STAGES and cycle is None:
        raise UserError(f"inspect {stage} needs --cycle K")
    refs = {
        PREFLIGHT: lambda: preflight_ref(),
        ROLLOUT: lambda: rollout_ref(cycle),
        TEACHER_SCORE: lambda: teacher_score_ref(cycle),
        GRADIENT: lambda: gradient_ref(cycle),
        OPTIMIZER_STEP: lambda: checkpoint_ref(cycle + 1),
        VERIFY: lambda: verify_ref(label or FINAL),
    }
    if stage not in refs:
        raise UserError(f"inspect knows the stages {', '.join(refs)}; or pass an artifact file path")
    return refs[stage]()
