"""What a person and a tool see while a run goes: events.jsonl lines and the console.

The driver calls the observer at each stage boundary; stages never print or log
progress lines themselves. `events.jsonl` is for tools and plots, the console
line is for the person watching (one per cycle, one per verify).
"""

from __future__ import annotations

from typing import Any, Callable

from miniverl.engine.core import layout
from miniverl.engine.core.artifacts import CycleSummary, RolloutSummary
from miniverl.engine.core.layout import Ref, StageKey
from miniverl.engine.core.progress import Reporter
from miniverl.engine.core.recipe import Recipe
from miniverl.engine.core.rundir import RunDir, StageRecord

Reader = Callable[[Ref], Any]  # reads an artifact the journal vouches for


class Observer:
    def __init__(self, run: RunDir, recipe: Recipe, reporter: Reporter):
        self.run = run
        self.recipe = recipe
        self.reporter = reporter

    def stage_started(self, key: StageKey, attempt: int) -> None:
        self.run.event("stage_start", stage=key.id, attempt=attempt)

    def stage_failed(self, key: StageKey, error: str) -> None:
        self.run.event("stage_failed", stage=key.id, error=error[:500])

    def corrupt_output(self, key: StageKey, path: str, dropped: bool = False) -> None:
        self.run.event("corrupt_output", stage=key.id, file=path, dropped=dropped)
        if dropped:
            self.reporter.line(f"[yellow]{path} is missing or corrupt and cannot be remade (its inputs were pruned); "
                               "no stage still to run reads it, so it is dropped[/]")
        else:
            self.reporter.line(f"[yellow]{path} is missing or corrupt; recomputing {key.id}[/]")

    def oom_retry(self, key: StageKey, chunk_size: int, next_chunk_size: int, error: str | None) -> None:
        self.run.event("oom_retry", stage=key.id, chunk_size=chunk_size, next_chunk_size=next_chunk_size, error=error)
        self.reporter.line(f"[yellow]out of memory at loss.chunk_size {chunk_size}; "
                           f"retrying the gradient stage with {next_chunk_size}[/]")

    def stage_done(self, key: StageKey, record: StageRecord, peak_reserved: int, read: Reader,
                   records: dict[str, StageRecord]) -> None:
        if key.name == layout.VERIFY:
            self._verified(key, read)
        self.run.event("stage_end", stage=key.id, seconds=round(record.seconds or 0.0, 3),
                       peak_memory_bytes=record.peak_memory_bytes, peak_reserved_bytes=peak_reserved)
        if key.name == layout.OPTIMIZER_STEP:
            self._cycle_done(key.cycle, records)

    def _verified(self, key: StageKey, read: Reader) -> None:
        report = read(layout.verify_ref(key.label))
        self.reporter.line(f"verify ({key.label}): tool-call {report.tool_call_rate:.0%}, "
                           f"format {report.format_validity:.0%}, strict success {report.strict_success:.0%}")
        self.run.event("verify", label=key.label, tool_call_rate=report.tool_call_rate,
                       format_validity=report.format_validity, strict_success=report.strict_success)

    def _cycle_done(self, cycle: int, records: dict[str, StageRecord]) -> None:
        grad = records[StageKey(layout.GRADIENT, cycle).id].summary_as(CycleSummary)
        rollout = records[StageKey(layout.ROLLOUT, cycle).id].summary_as(RolloutSummary)
        tool, success = rollout.tool_call_rate, rollout.rollout_success
        # The optimizer step is not counted: its seconds are not final until its journal entry is.
        timed = [records[StageKey(name, cycle).id] for name in layout.CYCLE_STAGES[:-1]]
        seconds = sum(r.seconds or 0.0 for r in timed)
        peak = max(r.peak_memory_bytes or 0 for r in timed)
        self.run.event("cycle", cycle=cycle, loss=grad.loss, kl=grad.kl, tool_call_rate=tool,
                       rollout_success=success, chunk_size=grad.chunk_size)
        self.reporter.line(
            f"cycle {cycle + 1}/{self.recipe.train.cycles}  loss {grad.loss:+.4f}  kl {grad.kl:.4f}  "
            f"tool-call {tool:.0%}  success {success:.0%}  {seconds:.1f}s  peak {peak / 2**30:.2f} GiB"
        )
