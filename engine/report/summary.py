"""What a run measured, gathered once for `report` and `export-benchmark`.

Everything comes from files the journal vouches for: an artifact is read only
if its stage is done, and its bytes must match the hash the journal recorded.
A run that is not finished yields what it has so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miniverl.engine.core import layout
from miniverl.engine.core.artifacts import CycleSummary, Manifest, Rollout, RolloutSummary, Trajectory, VerifyReport
from miniverl.engine.core.layout import Ref, stage_order
from miniverl.engine.core.errors import MiniverlError
from miniverl.engine.core.recipe import Recipe
from miniverl.engine.core.rundir import Journal, RunDir
from miniverl.engine.report.runs_table import RunRow, run_row


@dataclass(frozen=True)
class CycleFigures:
    cycle: int
    loss: float | None
    kl: float | None
    tool_call_rate: float | None  # over this cycle's rollout
    rollout_success: float | None
    generated_tokens: int | None
    rollout_seconds: float | None
    chunk_size: int | None
    oom_retries: int

    @property
    def tokens_per_second(self) -> float | None:
        if not self.generated_tokens or not self.rollout_seconds:
            return None
        return self.generated_tokens / self.rollout_seconds


@dataclass(frozen=True)
class StageFigures:
    stage: str
    state: str
    seconds: float | None
    peak_memory_bytes: int | None
    attempts: int


@dataclass
class RunSummary:
    run: RunDir
    recipe: Recipe
    row: RunRow
    cycles: list[CycleFigures]
    stages: list[StageFigures]
    verify: dict[str, VerifyReport]  # baseline | final
    rollouts: dict[int, Rollout]
    manifest: Manifest | None
    device: str | None  # as preflight resolved it (resolved.json)
    missing: list[str] = field(default_factory=list)  # artifacts that could not be read, and why

    def trajectories(self, per_cycle: int) -> list[tuple[int, Trajectory]]:
        """A few trajectories of the first and the last cycle rolled out."""
        if not self.rollouts:
            return []
        picked = sorted({min(self.rollouts), max(self.rollouts)})
        return [(c, t) for c in picked for t in self.rollouts[c].trajectories[:per_cycle]]


def _read(run: RunDir, journal: Journal, ref: Ref, missing: list[str]) -> Any:
    """The artifact if its stage is done and its bytes are the ones journaled; else None (and why)."""
    try:
        return run.read_recorded(journal, ref)
    except MiniverlError as exc:
        missing.append(str(exc))
        return None


def summarize(run: RunDir, recipe: Recipe) -> RunSummary:
    journal = run.read_journal()
    missing: list[str] = []
    cycles, rollouts = [], {}
    for c in range(recipe.train.cycles):
        # The figures are the summaries the stages left in the journal: they outlive pruned files.
        record = journal.stages.get(layout.rollout_ref(c).producer.id)
        gradient = journal.stages.get(layout.gradient_ref(c).producer.id)
        rollout = record.summary_as(RolloutSummary) if record is not None else None
        grad = gradient.summary_as(CycleSummary) if gradient is not None else None
        if rollout is None and grad is None:
            continue
        if not journal.is_pruned(layout.rollout_ref(c)):
            full = _read(run, journal, layout.rollout_ref(c), missing)
            if full is not None:
                rollouts[c] = full
        cycles.append(CycleFigures(
            cycle=c,
            loss=grad.loss if grad else None,
            kl=grad.kl if grad else None,
            tool_call_rate=rollout.tool_call_rate if rollout else None,
            rollout_success=rollout.rollout_success if rollout else None,
            generated_tokens=rollout.generated_tokens if rollout else None,
            rollout_seconds=record.seconds if record is not None and record.state == "done" else None,
            chunk_size=grad.chunk_size if grad else None,
            oom_retries=sum(1 for a in grad.attempts if not a.ok) if grad else 0,
        ))
    verify = {}
    for label in layout.VERIFY_LABELS:
        report = _read(run, journal, layout.verify_ref(label), missing)
        if report is not None:
            verify[label] = report
    stages = [StageFigures(key, rec.state, rec.seconds, rec.peak_memory_bytes, rec.attempts)
              for key, rec in sorted(journal.stages.items(), key=lambda item: stage_order(item[0]))]
    manifest = run.read_manifest()
    try:
        device = _read(run, journal, layout.resolved_ref(), missing)["resolved"]["device"]["value"]
    except (KeyError, TypeError):
        device = None
    return RunSummary(run, recipe, run_row(run), cycles, stages, verify, rollouts, manifest, device, missing)


def stage_totals(stages: list[StageFigures]) -> dict[str, dict[str, float | int]]:
    """Per stage name (cycles folded together): total seconds, peak memory, count."""
    totals: dict[str, dict[str, float | int]] = {}
    for s in stages:
        if s.state != "done":
            continue
        name = layout.StageKey.parse(s.stage).name
        entry = totals.setdefault(name, {"seconds": 0.0, "peak_memory_bytes": 0, "count": 0})
        entry["seconds"] += s.seconds or 0.0
        entry["peak_memory_bytes"] = max(entry["peak_memory_bytes"], s.peak_memory_bytes or 0)
        entry["count"] += 1
    return totals
