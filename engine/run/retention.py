"""Retention: which checkpoints and cycle artifacts a run removes, and how it removes them safely.

A run keeps, with the default recipe, the last two checkpoints and the last
cycle's rollout, teacher scores and gradient, so its disk use does not grow
with the number of cycles (`checkpoints: {keep_last, keep_every}`,
`artifacts: {keep: last | none | all}`). Only what no stage still to run reads
is removed: cycle k's artifacts once checkpoint k+1 (which consumed them) is
journaled done, a checkpoint once it has left the kept window and the stages
that read it are done. The latest checkpoint, which the final verify and an
export read, is never removed.

Removal is journaled like any write: first one journal record marks the paths
pruned (from then on they count as intentionally absent), then the files go.
A kill between the two leaves files the journal already calls pruned; the
next process's `sweep` removes them. A kill before the record leaves
everything as it was, and the next pass prunes it.
"""

from __future__ import annotations

from typing import Iterator

from miniverl.engine.core import layout
from miniverl.engine.core.atomic_io import fsync_dir
from miniverl.engine.core.faults import kill_point
from miniverl.engine.core.layout import StageKey
from miniverl.engine.core.recipe import Recipe
from miniverl.engine.core.rundir import Journal, RunDir
from miniverl.stages.contract import checkpoint_refs

CYCLE_ARTIFACT_STAGES = (layout.ROLLOUT, layout.TEACHER_SCORE, layout.GRADIENT)


def checkpoint_kept(recipe: Recipe, step: int, latest: int) -> bool:
    keep = recipe.checkpoints
    return step > latest - keep.keep_last or (keep.keep_every > 0 and step % keep.keep_every == 0)


class Retention:
    def __init__(self, run: RunDir, recipe: Recipe, journal: Journal):
        self.run, self.recipe, self.journal = run, recipe, journal

    # ---------------------------------------------------------------- what may go
    def _done(self, key: StageKey) -> bool:
        record = self.journal.stages.get(key.id)
        return record is not None and record.state == "done"

    def _cycle_prunable(self, cycle: int, latest: int) -> bool:
        """Cycle `cycle`'s artifacts, once checkpoint `latest` is durable."""
        keep = self.recipe.artifacts.keep
        if keep == "all" or not self._done(StageKey(layout.OPTIMIZER_STEP, cycle)):
            return False
        return cycle < latest - 1 if keep == "last" else cycle < latest

    def _checkpoint_prunable(self, step: int, latest: int) -> bool:
        if checkpoint_kept(self.recipe, step, latest):
            return False
        readers = [StageKey(name, step) for name in (layout.ROLLOUT, layout.GRADIENT, layout.OPTIMIZER_STEP)]
        if step == 0:
            readers.append(StageKey(layout.VERIFY, label=layout.BASELINE))
        return all(self._done(key) for key in readers if key.cycle is None or key.cycle < self.recipe.train.cycles)

    def _targets(self, cycles: Iterator[int], steps: Iterator[int], latest: int) -> dict[str, list[str]]:
        """Stage id -> its output paths to prune now (those not pruned already)."""
        found: dict[str, list[str]] = {}

        def take(producer: StageKey, paths: set[str] | None) -> None:
            record = self.journal.stages.get(producer.id)
            if record is None or record.state != "done":
                return
            fresh = [p for p in record.outputs if (paths is None or p in paths) and p not in record.pruned]
            if fresh:
                found.setdefault(producer.id, []).extend(fresh)

        for cycle in cycles:
            if 0 <= cycle and self._cycle_prunable(cycle, latest):
                for name in CYCLE_ARTIFACT_STAGES:
                    take(StageKey(name, cycle), None)
        for step in steps:
            if 0 <= step < latest and self._checkpoint_prunable(step, latest):
                take(layout.checkpoint_producer(step), {ref.path for ref in checkpoint_refs(step)})
        return found

    # ---------------------------------------------------------------- passes
    def after_step(self, cycle: int) -> None:
        """Checkpoint cycle+1 is durable: prune what just left the kept window (O(1) per cycle)."""
        latest = cycle + 1
        window = latest - self.recipe.checkpoints.keep_last
        self._prune(self._targets(iter((cycle - 1, cycle)), iter((window, window - 1)), latest))

    def sweep(self) -> None:
        """Once per process: everything the policy allows (a pass a kill cut short), and any file the
        journal calls pruned that is still on disk (a kill between the record and the removal)."""
        latest = self._latest_checkpoint()
        if latest is not None:
            self._prune(self._targets(iter(range(latest)), iter(range(latest)), latest))
        leftovers = [path for record in self.journal.stages.values() for path in record.pruned
                     if (self.run.root / path).exists()]
        self._remove(leftovers)

    def _latest_checkpoint(self) -> int | None:
        done = [c for c in range(self.recipe.train.cycles) if self._done(StageKey(layout.OPTIMIZER_STEP, c))]
        return max(done) + 1 if done else None

    def _prune(self, targets: dict[str, list[str]]) -> None:
        if not targets:
            return
        for stage_id, paths in targets.items():
            self.journal.stages[stage_id].pruned.extend(paths)
        self.run.record(self.journal, *targets)
        kill_point("prune:journaled")
        paths = [path for found in targets.values() for path in found]
        self.run.event("pruned", files=paths)
        self._remove(paths)

    def _remove(self, paths: list[str]) -> None:
        parents = set()
        for path in paths:
            (self.run.root / path).unlink(missing_ok=True)
            kill_point(f"prune:removed:{path}")
            parents.add((self.run.root / path).parent)
        for parent in sorted(parents):
            try:
                parent.rmdir()  # only when nothing else is left in it
            except OSError:
                pass
            fsync_dir(parent.parent if not parent.exists() else parent)
