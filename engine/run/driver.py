"""The driver: walks the stage plan, skipping what the journal says is done.

preflight -> verify(baseline) -> [rollout -> teacher_score -> gradient -> optimizer_step] x N
          -> verify(final) -> manifest

For each stage: mark it running in the journal, read its inputs (checking the
hashes the journal recorded for them), run it, write its outputs atomically,
and only then record it done with its output hashes. A crash at any instant
therefore leaves a stage either done (all outputs intact) or not, and
`resume` reruns exactly the stages that are not done.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from miniverl.stages import gradient, manifest, optimizer_step, preflight, rollout, teacher_score, verify

from miniverl.engine.core.artifacts import (
    Checkpoint, Gradient, Preflight, Rollout, TeacherScore, VerifyReport,
    read_artifact, read_tensors, write_artifact, write_tensors,
)
from miniverl.engine.core.atomic_io import sha256_file, write_bytes_atomic
from miniverl.engine.core.device import PeakMemory
from miniverl.engine.core.errors import ArtifactError, MiniverlError, StageFailed
from miniverl.engine.core.faults import kill_point
from miniverl.engine.models.host import ModelHost
from miniverl.engine.core.progress import Reporter
from miniverl.engine.core.recipe import Recipe
from miniverl.engine.core.rundir import RunDir, StageRecord

STAGE_NAMES = ("preflight", "rollout", "teacher_score", "gradient", "optimizer_step", "verify", "manifest")


@dataclass(frozen=True)
class StageKey:
    name: str
    cycle: int | None = None  # rollout..optimizer_step
    label: str | None = None  # verify: baseline | final

    @property
    def id(self) -> str:
        if self.cycle is not None:
            return f"c{self.cycle:06d}/{self.name}"
        return f"{self.name}@{self.label}" if self.label else self.name


def plan(recipe: Recipe) -> list[StageKey]:
    keys = [StageKey("preflight"), StageKey("verify", label="baseline")]
    for cycle in range(recipe.train.cycles):
        keys += [StageKey(name, cycle) for name in ("rollout", "teacher_score", "gradient", "optimizer_step")]
    return keys + [StageKey("verify", label="final"), StageKey("manifest")]


class Pipeline:
    def __init__(self, run: RunDir, recipe: Recipe, reporter: Reporter, host: ModelHost):
        self.run = run
        self.recipe = recipe
        self.reporter = reporter
        self.host = host
        self.journal = run.read_journal()
        self.keys = plan(recipe)

    # ---------------------------------------------------------------- walking
    def run_all(self) -> None:
        for key in self.keys:
            if not self._is_done(key):
                self.execute(key)

    def _is_done(self, key: StageKey) -> bool:
        record = self.journal.stages.get(key.id)
        if record is None or record.state != "done":
            return False
        for relative, digest in record.outputs.items():
            path = self.run.root / relative
            if not path.is_file() or sha256_file(path) != digest:
                self.run.event("corrupt_output", stage=key.id, file=relative)
                self.reporter.line(f"[yellow]{relative} is missing or corrupt; recomputing {key.id}[/]")
                return False
        return True

    def execute(self, key: StageKey) -> None:
        record = self.journal.stages.setdefault(key.id, StageRecord())
        previous_outputs = dict(record.outputs)
        record.state, record.pid, record.started, record.error = "running", os.getpid(), time.time(), None
        record.attempts += 1
        self.run.write_journal(self.journal)
        self.run.event("stage_start", stage=key.id, attempt=record.attempts)
        kill_point(f"{key.id}:start")
        peak = PeakMemory(self.host.device)
        started = time.perf_counter()
        try:
            with peak.track():
                outputs = getattr(self, f"_stage_{key.name}")(key)
        except Exception as exc:
            record.state, record.error = "failed", f"{type(exc).__name__}: {exc}"
            self._record_failure(key, exc)
            if isinstance(exc, MiniverlError):
                raise
            raise StageFailed(f"stage {key.id} failed ({record.error.splitlines()[0][:300]}); details in "
                              f"{self.run.root / 'errors.log'}; fix the cause, then `miniverl resume {self.run.root.name}`") from exc
        kill_point(f"{key.id}:before-journal")
        record.state, record.outputs = "done", outputs
        record.seconds, record.peak_memory_bytes = time.perf_counter() - started, peak.allocated
        if previous_outputs and previous_outputs != outputs:
            self._invalidate_after(key)
        self.run.write_journal(self.journal)
        self.run.event("stage_end", stage=key.id, seconds=round(record.seconds, 3),
                       peak_memory_bytes=peak.allocated, peak_reserved_bytes=peak.reserved)

    def _record_failure(self, key: StageKey, exc: Exception) -> None:
        """Best effort: the journal and a traceback log; a full disk may refuse both."""
        import traceback

        try:
            self.run.write_journal(self.journal)
            self.run.event("stage_failed", stage=key.id, error=str(exc)[:500])
            with open(self.run.root / "errors.log", "a", encoding="utf-8") as log:
                log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {key.id}\n")
                log.write("".join(traceback.format_exception(exc)))
        except OSError:
            pass

    def _invalidate_after(self, key: StageKey) -> None:
        """A recomputed stage produced different bytes: later stages must rerun."""
        later = self.keys[self.keys.index(key) + 1:]
        for other in later:
            if other.id in self.journal.stages:
                self.journal.stages[other.id].state = "pending"

    # ---------------------------------------------------------------- reading inputs
    def _digest(self, key_id: str, relative: str) -> str:
        record = self.journal.stages.get(key_id)
        if record is None or record.state != "done" or relative not in record.outputs:
            raise StageFailed(f"input {relative} is not ready: stage {key_id} has not completed; run `miniverl resume`")
        return record.outputs[relative]

    def _read(self, key_id: str, relative: str, kind):
        return read_artifact(self.run.root / relative, kind, self._digest(key_id, relative))

    def preflight_artifact(self) -> Preflight:
        return self._read("preflight", "preflight.msgpack", Preflight)

    def _producer_of_checkpoint(self, step: int) -> str:
        return "preflight" if step == 0 else StageKey("optimizer_step", step - 1).id

    def policy(self, step: int) -> tuple[Checkpoint, dict[str, torch.Tensor]]:
        relative = f"{self.run.checkpoint_dir(step)}/checkpoint.msgpack"
        checkpoint = self._read(self._producer_of_checkpoint(step), relative, Checkpoint)
        return checkpoint, read_tensors(self.run.root, checkpoint.adapter)

    def _cycle_file(self, cycle: int, name: str) -> str:
        return f"{self.run.cycle_dir(cycle)}/{name}"

    # ---------------------------------------------------------------- stages
    def _stage_preflight(self, key: StageKey) -> dict[str, str]:
        artifact, adapter = preflight.run(self.recipe, self.host)
        resolved = {k: {"value": r.value, "reason": r.reason} for k, r in artifact.resolved.items()}
        write_bytes_atomic(self.run.root / "resolved.json", json.dumps(
            {"recipe": artifact.recipe, "resolved": resolved}, indent=2, sort_keys=True).encode())
        outputs = {"resolved.json": sha256_file(self.run.root / "resolved.json")}
        outputs["preflight.msgpack"] = write_artifact(self.run.root / "preflight.msgpack", artifact)
        outputs.update(self._write_checkpoint(0, adapter, {}, {}))
        return outputs

    def _write_checkpoint(self, step: int, adapter: dict[str, torch.Tensor], opt_tensors: dict[str, torch.Tensor],
                          opt_scalars: dict[str, float]) -> dict[str, str]:
        directory = self.run.checkpoint_dir(step)
        adapter_file = write_tensors(self.run.root, f"{directory}/adapter.safetensors", adapter)
        kill_point(f"checkpoint{step}:after-adapter")
        optimizer_file = write_tensors(self.run.root, f"{directory}/optimizer.safetensors", opt_tensors) if opt_tensors else None
        student = self.recipe.models.student
        checkpoint = Checkpoint(
            step=step, adapter=adapter_file, optimizer=optimizer_file, optimizer_scalars=opt_scalars,
            adapter_sha256=adapter_file.sha256, base_id=student.id, base_revision=student.revision,
            base_config_sha256=sha256_file(self.host.student_dir / "config.json"),
            lora=msgspec.to_builtins(student.lora),
        )
        outputs = {adapter_file.path: adapter_file.sha256}
        if optimizer_file is not None:
            outputs[optimizer_file.path] = optimizer_file.sha256
        outputs[f"{directory}/checkpoint.msgpack"] = write_artifact(self.run.root / directory / "checkpoint.msgpack", checkpoint)
        return outputs

    def _stage_verify(self, key: StageKey) -> dict[str, str]:
        step = 0 if key.label == "baseline" else self.recipe.train.cycles
        checkpoint, adapter = self.policy(step)
        report = verify.run(self.recipe, self.host, adapter, checkpoint.adapter_sha256, key.label or "", self.reporter)
        relative = f"verify/{'baseline' if key.label == 'baseline' else 'report'}.msgpack"
        self.reporter.line(f"verify ({key.label}): tool-call {report.tool_call_rate:.0%}, "
                           f"format {report.format_validity:.0%}, strict success {report.strict_success:.0%}")
        self.run.event("verify", label=key.label, tool_call_rate=report.tool_call_rate,
                       format_validity=report.format_validity, strict_success=report.strict_success)
        return {relative: write_artifact(self.run.root / relative, report)}

    def _stage_rollout(self, key: StageKey) -> dict[str, str]:
        checkpoint, adapter = self.policy(key.cycle)
        artifact = rollout.run(self.recipe, self.host, adapter, checkpoint.adapter_sha256, key.cycle, self.reporter)
        relative = self._cycle_file(key.cycle, "rollout.msgpack")
        return {relative: write_artifact(self.run.root / relative, artifact)}

    def _rollout(self, cycle: int) -> tuple[Rollout, str]:
        relative = self._cycle_file(cycle, "rollout.msgpack")
        digest = self._digest(StageKey("rollout", cycle).id, relative)
        return read_artifact(self.run.root / relative, Rollout, digest), digest

    def _stage_teacher_score(self, key: StageKey) -> dict[str, str]:
        artifact, digest = self._rollout(key.cycle)
        positions, tensors = teacher_score.run(self.recipe, self.host, artifact, self.reporter)
        tensor_file = write_tensors(self.run.root, self._cycle_file(key.cycle, "teacher_score.safetensors"), tensors)
        score = TeacherScore(key.cycle, self.recipe.loss.mode, digest, positions, tensor_file)
        relative = self._cycle_file(key.cycle, "teacher_score.msgpack")
        return {tensor_file.path: tensor_file.sha256, relative: write_artifact(self.run.root / relative, score)}

    def _stage_gradient(self, key: StageKey) -> dict[str, str]:
        artifact, digest = self._rollout(key.cycle)
        score = self._read(StageKey("teacher_score", key.cycle).id, self._cycle_file(key.cycle, "teacher_score.msgpack"), TeacherScore)
        if score.rollout_sha256 != digest:
            raise ArtifactError(f"teacher scores of cycle {key.cycle} belong to another rollout; rerun teacher_score")
        checkpoint, adapter = self.policy(key.cycle)

        def on_retry(old: int, new: int, error: str | None) -> None:
            self.run.event("oom_retry", stage=key.id, chunk_size=old, next_chunk_size=new, error=error)
            self.reporter.line(f"[yellow]out of memory at loss.chunk_size {old}; retrying the gradient stage with {new}[/]")

        kill_point(f"{key.id}:compute")
        grads, stats, n_micro, chunk, attempts = gradient.run(
            self.recipe, self.host, artifact, read_tensors(self.run.root, score.tensors), adapter, self.reporter, on_retry)
        tensor_file = write_tensors(self.run.root, self._cycle_file(key.cycle, "gradient.safetensors"), grads)
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))
        positions = max(stats.positions, 1)
        result = Gradient(key.cycle, checkpoint.adapter_sha256, tensor_file, stats.loss_sum / positions,
                          stats.kl_sum / positions, stats.positions, n_micro, chunk, attempts, norm)
        relative = self._cycle_file(key.cycle, "gradient.msgpack")
        return {tensor_file.path: tensor_file.sha256, relative: write_artifact(self.run.root / relative, result)}

    def _stage_optimizer_step(self, key: StageKey) -> dict[str, str]:
        checkpoint, adapter = self.policy(key.cycle)
        grad = self._read(StageKey("gradient", key.cycle).id, self._cycle_file(key.cycle, "gradient.msgpack"), Gradient)
        if grad.policy_adapter_sha256 != checkpoint.adapter_sha256:
            raise ArtifactError(f"gradient of cycle {key.cycle} was computed for another policy; rerun gradient")
        opt_tensors = read_tensors(self.run.root, checkpoint.optimizer) if checkpoint.optimizer else {}
        optimizer_name = self.preflight_artifact().resolved["optimizer.name"].value
        new_adapter, tensors, scalars, _ = optimizer_step.run(
            self.recipe, optimizer_name, self.host.device, adapter, opt_tensors, checkpoint.optimizer_scalars,
            read_tensors(self.run.root, grad.tensors))
        kill_point(f"{key.id}:after-update")
        outputs = self._write_checkpoint(key.cycle + 1, new_adapter, tensors, scalars)
        self._cycle_summary(key.cycle, grad)
        return outputs

    def _cycle_summary(self, cycle: int, grad: Gradient) -> None:
        artifact, _ = self._rollout(cycle)
        n = len(artifact.trajectories)
        tool = sum(t.tool_called for t in artifact.trajectories) / n
        success = sum(t.strict_success for t in artifact.trajectories) / n
        seconds = sum(self.journal.stages[StageKey(s, cycle).id].seconds or 0.0
                      for s in ("rollout", "teacher_score", "gradient"))
        peak = max(self.journal.stages[StageKey(s, cycle).id].peak_memory_bytes or 0
                   for s in ("rollout", "teacher_score", "gradient"))
        self.run.event("cycle", cycle=cycle, loss=grad.loss, kl=grad.kl, tool_call_rate=tool,
                       rollout_success=success, chunk_size=grad.chunk_size)
        self.reporter.line(
            f"cycle {cycle + 1}/{self.recipe.train.cycles}  loss {grad.loss:+.4f}  kl {grad.kl:.4f}  "
            f"tool-call {tool:.0%}  success {success:.0%}  {seconds:.1f}s  peak {peak / 2**30:.2f} GiB"
        )

    def _stage_manifest(self, key: StageKey) -> dict[str, str]:
        document = manifest.build(self)
        data = json.dumps(document, indent=2, sort_keys=True).encode()
        write_bytes_atomic(self.run.root / "manifest.json", data)
        return {"manifest.json": sha256_file(self.run.root / "manifest.json")}

    # ---------------------------------------------------------------- for the manifest
    def stage_records(self) -> dict[str, StageRecord]:
        return self.journal.stages

    def gradients(self) -> list[Gradient]:
        return [self._read(StageKey("gradient", c).id, self._cycle_file(c, "gradient.msgpack"), Gradient)
                for c in range(self.recipe.train.cycles)]

    def verify_report(self, label: str) -> VerifyReport:
        relative = f"verify/{'baseline' if label == 'baseline' else 'report'}.msgpack"
        return self._read(StageKey("verify", label=label).id, relative, VerifyReport)


def stage_key(recipe: Recipe, name: str, cycle: int | None, label: str | None = None) -> StageKey:
    keys = plan(recipe)
    for key in keys:
        if key.name == name and key.cycle == cycle and (label is None or key.label == label):
            return key
    raise KeyError(name)


def run_root(runs_dir: Path, run_id: str) -> RunDir:
    return RunDir.locate(runs_dir, run_id)
