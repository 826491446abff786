"""Which of a run's policy checkpoints a command takes, read as the journal vouches for it.

A finished run gives its final step; an unfinished one only the step the user
names (`--step K`), so nobody ships a half-trained adapter by accident.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miniverl.engine.core import layout
from miniverl.engine.core.artifacts import Checkpoint, Manifest, ModelIdentity, Preflight
from miniverl.engine.core.errors import ArtifactError, ArtifactPruned, RunStateError, UserError
from miniverl.engine.core.recipe import Recipe
from miniverl.engine.core.rundir import Journal, RunDir, pruned_message


@dataclass(frozen=True)
class RunCheckpoint:
    run: RunDir
    recipe: Recipe
    step: int
    finished: bool  # the run has its manifest
    checkpoint: Checkpoint
    adapter: dict[str, torch.Tensor]  # the student's adapter, by the names the run's model gives them
    preflight: Preflight
    manifest: Manifest | None

    def model(self, role: str) -> ModelIdentity:
        """The student's or the teacher's identity as preflight recorded it."""
        return next(m for m in self.preflight.models if m.role == role)

    @property
    def is_final(self) -> bool:
        """The adapter the run's final verifier scored."""
        return self.finished and self.step == self.recipe.train.cycles


def _done(journal: Journal, step: int) -> bool:
    ref = layout.checkpoint_ref(step)
    record = journal.stages.get(ref.producer.id)
    return record is not None and record.state == "done" and ref.path in record.outputs


def latest_step(journal: Journal, cycles: int) -> int | None:
    """The highest step whose checkpoint is done (kept or not)."""
    return next((k for k in range(cycles, -1, -1) if _done(journal, k)), None)


def kept_steps(journal: Journal, cycles: int) -> list[int]:
    return [k for k in range(cycles + 1) if _done(journal, k) and not journal.is_pruned(layout.checkpoint_ref(k))]


def choose_step(run: RunDir, recipe: Recipe, journal: Journal, step: int | None) -> tuple[int, bool]:
    """(the step, whether the run is finished); every way a `--step` can be wrong is one line."""
    run_id, cycles = run.root.name, recipe.train.cycles
    manifest = journal.stages.get(layout.manifest_ref().producer.id)
    finished = manifest is not None and manifest.state == "done"
    latest = latest_step(journal, cycles)
    if latest is None:
        raise RunStateError(f"run {run_id} has no checkpoint yet (preflight has not run); "
                            f"`miniverl resume {run_id}` starts it")
    if step is None:
        if finished:
            return cycles, True
        raise RunStateError(f"run {run_id} is not finished (latest checkpoint: step {latest} of {cycles}); "
                            f"pass --step {latest} to take that checkpoint anyway, or finish the run with "
                            f"`miniverl resume {run_id}`")
    if not 0 <= step <= cycles:
        raise UserError(f"--step {step} is out of range: run {run_id} has steps 0..{cycles} "
                        f"(0 is the untrained adapter)")
    if not _done(journal, step):
        raise UserError(f"--step {step} is not trained yet: run {run_id} has reached step {latest}")
    if journal.is_pruned(layout.checkpoint_ref(step)):
        kept = ", ".join(map(str, kept_steps(journal, cycles)))
        raise ArtifactPruned(f"--step {step}: {pruned_message(layout.checkpoint_ref(step).path)}; "
                             f"the run keeps steps {kept}")
    return step, finished


def read_checkpoint(run: RunDir, recipe: Recipe, step: int | None) -> RunCheckpoint:
    journal = run.read_journal()
    step, finished = choose_step(run, recipe, journal, step)
    try:
        checkpoint = run.read_recorded(journal, layout.checkpoint_ref(step))
        adapter = run.read_recorded(journal, layout.adapter_ref(step))
        preflight = run.read_recorded(journal, layout.preflight_ref())
    except ArtifactError as exc:
        raise ArtifactError(f"{exc}; `miniverl resume {run.root.name}` remakes it") from None
    return RunCheckpoint(run, recipe, step, finished, checkpoint, adapter, preflight,
                         run.read_manifest() if finished else None)
