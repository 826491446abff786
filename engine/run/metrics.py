"""Live metrics: one `metrics.jsonl` line per finished cycle, and the same scalars to TensorBoard and wandb.

`events.jsonl` stays the record of what happened; these are its figures per
cycle, for plots while a run goes. Every figure comes from the journal (stage
seconds and peaks, the summaries stages leave there), so a resumed run
catches up on the cycles it finished before it was stopped, and nothing is
sent twice:

- `metrics.jsonl` is the ledger: a cycle with a line has gone to every sink.
  A line torn by a kill is cut off before the next append.
- TensorBoard: the event files already in `tensorboard/` are read back once
  per process, and a (tag, step) point already there is not written again
  (this also keeps `miniverl report` from adding a second copy).
- wandb: a cycle without a ledger line is logged again after a kill between
  the two, at the same step. wandb buffers in its own service process, so
  points it had not written when the run was SIGKILLed can be lost; a kill
  never makes them appear twice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

import msgspec

from miniverl.engine.core import layout
from miniverl.engine.core.artifacts import CycleSummary, RolloutSummary
from miniverl.engine.core.atomic_io import append_line, truncate_file
from miniverl.engine.core.errors import RecipeError
from miniverl.engine.core.faults import kill_point
from miniverl.engine.core.layout import StageKey
from miniverl.engine.core.recipe import Recipe
from miniverl.engine.core.rundir import RunDir, StageRecord

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class CycleMetrics(msgspec.Struct, frozen=True):
    cycle: int
    loss: float
    kl: float
    grad_norm: float
    tool_call_rate: float  # over this cycle's rollout
    rollout_success: float  # strict success of the sampled trajectories
    generated_tokens: int
    tokens_per_second: float | None  # generated tokens over the rollout stage's seconds
    seconds: dict[str, float]  # per stage of the cycle
    cycle_seconds: float
    peak_memory_bytes: int  # the largest of the cycle's stages
    chunk_size: int


def cycle_metrics(records: Mapping[str, StageRecord], cycle: int) -> CycleMetrics | None:
    """The cycle's figures once all its stages are done, from the journal alone."""
    stages = {name: records.get(StageKey(name, cycle).id) for name in layout.CYCLE_STAGES}
    if any(r is None or r.state != "done" for r in stages.values()):
        return None
    grad = stages[layout.GRADIENT].summary_as(CycleSummary)
    rollout = stages[layout.ROLLOUT].summary_as(RolloutSummary)
    if grad is None or rollout is None:
        return None
    seconds = {name: round(r.seconds or 0.0, 4) for name, r in stages.items()}
    rollout_seconds = stages[layout.ROLLOUT].seconds
    return CycleMetrics(
        cycle=cycle, loss=grad.loss, kl=grad.kl, grad_norm=grad.grad_norm, tool_call_rate=rollout.tool_call_rate,
        rollout_success=rollout.rollout_success, generated_tokens=rollout.generated_tokens,
        tokens_per_second=rollout.generated_tokens / rollout_seconds if rollout_seconds else None,
        seconds=seconds, cycle_seconds=round(sum(seconds.values()), 4),
        peak_memory_bytes=max(r.peak_memory_bytes or 0 for r in stages.values()), chunk_size=grad.chunk_size,
    )


def scalars(m: CycleMetrics) -> dict[str, float]:
    """The cycle as tagged scalars (TensorBoard and wandb get the same ones)."""
    points = {
        "train/loss": m.loss, "train/kl": m.kl, "train/grad_norm": m.grad_norm, "train/chunk_size": m.chunk_size,
        "rollout/tool_call_rate": m.tool_call_rate, "rollout/strict_success": m.rollout_success,
        "rollout/generated_tokens": m.generated_tokens,
        "time/cycle_seconds": m.cycle_seconds, "memory/peak_gib": m.peak_memory_bytes / 2**30,
        **{f"time/{name}_seconds": s for name, s in m.seconds.items()},
    }
    if m.tokens_per_second is not None:
        points["rollout/tokens_per_second"] = m.tokens_per_second
    return points


def verify_scalars(report: Any) -> dict[str, float]:
    return {"verify/strict_success": report.strict_success, "verify/tool_call_rate": report.tool_call_rate,
            "verify/format_validity": report.format_validity}


def missing_package(recipe: Recipe) -> str | None:
    """A sink the recipe asks for whose package is not installed: one line naming the key and the fix."""
    if recipe.report.tensorboard and _tensorboard_module() is None:
        return ("recipe key report.tensorboard: the tensorboard package is not installed; "
                "pip install tensorboard (or set report.tensorboard: false)")
    if recipe.report.wandb is not None and _wandb_module() is None:
        return "recipe key report.wandb: the wandb package is not installed; pip install wandb (or remove report.wandb)"
    return None


def _tensorboard_module():
    try:
        import tensorboard
    except ImportError:
        return None
    return tensorboard


def _wandb_module():
    try:
        import wandb
    except ImportError:
        return None
    return wandb


# ---------------------------------------------------------------- sinks
class TensorBoardSink:
    """Scalars in `directory`; points already in its event files (from any process) are not written again."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._written: set[tuple[str, int]] | None = None
        self._writer = None

    def _points_on_disk(self) -> set[tuple[str, int]]:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

        found: set[tuple[str, int]] = set()
        for file in sorted(self.directory.glob("events.out.tfevents.*")):
            for event in EventFileLoader(str(file)).Load():  # stops at a record torn by a kill
                found.update((value.tag, event.step) for value in event.summary.value)
        return found

    def write(self, points: dict[str, float], step: int) -> None:
        if self._written is None:
            self._written = self._points_on_disk()
        new = {tag: value for tag, value in points.items() if (tag, step) not in self._written}
        if not new:
            return
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.directory))
        for tag, value in new.items():
            self._writer.add_scalar(tag, value, step)
            self._written.add((tag, step))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbSink:
    def __init__(self, run: RunDir, recipe: Recipe):
        self.run_dir, self.recipe = run.root, recipe
        self._run = None

    def write(self, points: dict[str, float], step: int) -> None:
        if self._run is None:
            wandb = _wandb_module()
            if wandb is None:
                raise RecipeError(missing_package(self.recipe) or "wandb is not installed")
            spec = self.recipe.report.wandb
            # The run id names the wandb run, so a resumed run continues the same one.
            self._run = wandb.init(project=spec.project, entity=spec.entity, name=self.run_dir.name,
                                   id=self.run_dir.name, resume="allow", mode=spec.mode, dir=str(self.run_dir),
                                   config=msgspec.to_builtins(self.recipe))
        self._run.log(points, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class LiveMetrics:
    """The driver calls `catch_up` after every stage and `close` at the end; everything else follows.

    O(1) per call: cycles finish in order, so the ledger is a prefix of the cycles
    (and the verify labels done), and only the next cycle is looked at.
    """

    def __init__(self, run: RunDir, recipe: Recipe):
        self.run, self.recipe = run, recipe
        self.path = run.root / METRICS_FILE
        self._next_cycle: int | None = None  # the first cycle without a ledger line
        self._verified: set[str] = set()
        self.sinks: list[Any] = []
        if recipe.report.tensorboard:
            self.sinks.append(TensorBoardSink(run.root / TENSORBOARD_DIR))
        if recipe.report.wandb is not None:
            self.sinks.append(WandbSink(run, recipe))

    def _read_ledger(self) -> None:
        """What earlier processes logged; a torn last line (a kill mid-append) is cut off."""
        self._next_cycle = 0
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        whole = data[: data.rfind(b"\n") + 1]
        if len(whole) != len(data):
            truncate_file(self.path, len(whole))
        for line in whole.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry.get("cycle"), int):
                self._next_cycle = max(self._next_cycle, entry["cycle"] + 1)
            elif isinstance(entry.get("verify"), str):
                self._verified.add(entry["verify"])

    def _send(self, points: dict[str, float], step: int, line: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(points, step)
        kill_point("metrics:sent")  # the sinks have the point, the ledger does not yet
        append_line(self.path, json.dumps(line, sort_keys=True))  # the ledger line last: it says "sent"

    def catch_up(self, records: Mapping[str, StageRecord], read_verify: Callable[[str], Any]) -> None:
        """Send every finished cycle not yet in the ledger, in order, and each finished verify once.

        The baseline verify is step 0, cycle k is step k + 1 (the policy after k + 1
        updates), the final verify the last step: the sinks' steps only grow.
        """
        if self._next_cycle is None:
            self._read_ledger()
        cycles = self.recipe.train.cycles
        self._send_verify(records, layout.BASELINE, read_verify)
        while self._next_cycle < cycles and (m := cycle_metrics(records, self._next_cycle)) is not None:
            self._send(scalars(m), m.cycle + 1, msgspec.to_builtins(m))
            self._next_cycle += 1
        if self._next_cycle == cycles:
            self._send_verify(records, layout.FINAL, read_verify)

    def _send_verify(self, records: Mapping[str, StageRecord], label: str, read_verify: Callable[[str], Any]) -> None:
        record = records.get(layout.verify_ref(label).producer.id)
        if label in self._verified or record is None or record.state != "done":
            return
        report, step = read_verify(label), layout.verified_step(label, self.recipe.train.cycles)
        if report is None:
            return
        points = verify_scalars(report)
        self._send(points, step, {"verify": label, "step": step, "tasks": report.tasks,
                                  **{tag.split("/")[1]: value for tag, value in points.items()}})
        self._verified.add(label)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
