"""The driver: walks the plan and runs each stage that is not done.

For one stage: mark it running in the journal; read the inputs it names
(each file checked against the hash its producer's journal entry recorded);
run it; write what it returns, each file atomically; and only then append the
record that marks it done, with the hashes of what it read and what it wrote. A crash at any
instant leaves a stage either done with all its outputs intact, or not done,
and `resume` reruns exactly the stages that are not.

A stage is done only while its outputs are intact and its inputs are still
the files its producers last wrote. So when a stage is recomputed and writes
different bytes, exactly the stages that read those bytes become pending.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

from miniverl.engine.core import layout
from miniverl.engine.core.atomic_io import sha256_file
from miniverl.engine.core.device import PeakMemory
from miniverl.engine.core.errors import ArtifactPruned, MiniverlError, StageFailed
from miniverl.engine.core.faults import kill_point
from miniverl.engine.core.layout import Ref, StageKey
from miniverl.engine.core.progress import Reporter
from miniverl.engine.core.recipe import Recipe
from miniverl.engine.core.rundir import RunDir, StageRecord, pruned_message
from miniverl.engine.models.host import ModelHost
from miniverl.engine.tasks.base import Task
from miniverl.engine.run.metrics import LiveMetrics
from miniverl.engine.run.observer import Observer
from miniverl.engine.run.retention import Retention
from miniverl.stages import gradient, manifest, optimizer_step, preflight, rollout, teacher_score, verify
from miniverl.stages.contract import Output, Stage, StageContext

STAGES: dict[str, Stage] = {s.NAME: s for s in (preflight, rollout, teacher_score, gradient, optimizer_step,
                                                verify, manifest)}


class Driver:
    def __init__(self, run: RunDir, recipe: Recipe, reporter: Reporter, host: ModelHost, task: Task):
        self.run, self.recipe, self.reporter, self.host, self.task = run, recipe, reporter, host, task
        self.journal = run.open_journal()
        self.observer = Observer(run, recipe, reporter)
        self.retention = Retention(run, recipe, self.journal)
        self.metrics = LiveMetrics(run, recipe)

    def run_all(self) -> None:
        self.retention.sweep()
        try:
            self._catch_up_metrics()  # cycles a stopped process finished but did not log
            for key in layout.plan(self.recipe.train.cycles):
                if not self.is_done(key):
                    self.execute(key)
                    self._catch_up_metrics()
        finally:
            self.metrics.close()

    def _catch_up_metrics(self) -> None:
        def verify_report(label: str) -> Any:
            try:
                return self.read(layout.verify_ref(label))
            except MiniverlError:  # corrupt or missing: the plan remakes it, and the point goes out then
                return None

        self.metrics.catch_up(self.journal.stages, verify_report)

    # ---------------------------------------------------------------- state
    def is_done(self, key: StageKey) -> bool:
        record = self.journal.stages.get(key.id)
        if record is None or record.state != "done":
            return False
        for path, digest in record.outputs.items():
            file = self.run.root / path
            if path in record.pruned:
                continue  # removed on purpose; no stage still to run reads it
            if not file.is_file() or sha256_file(file) != digest:
                if self._pruned_inputs(key, record):  # it cannot be remade, and nothing still to run needs it
                    self.observer.corrupt_output(key, path, dropped=True)
                    record.pruned.append(path)
                    self.run.record(self.journal, key.id)
                    file.unlink(missing_ok=True)
                    continue
                self.observer.corrupt_output(key, path)
                return False
        # Inputs are journal lookups, no file reads: still what the producers last wrote?
        return all(self._recorded(ref) == digest for ref, digest in self._input_digests(key, record))

    def _recorded(self, ref: Ref) -> str | None:
        record = self.journal.stages.get(ref.producer.id)
        if record is None or record.state != "done":
            return None
        return record.outputs.get(ref.path)

    def _pruned_inputs(self, key: StageKey, record: StageRecord) -> list[str]:
        """Inputs this stage read that the retention policy has removed since."""
        return [ref.path for ref, _ in self._input_digests(key, record) if self.journal.is_pruned(ref)]

    def _input_digests(self, key: StageKey, record: StageRecord) -> list[tuple[Ref, str]]:
        refs = {ref.path: ref for ref in STAGES[key.name].inputs(key, self.recipe).values()}
        return [(refs[path], digest) for path, digest in record.inputs.items() if path in refs]

    # ---------------------------------------------------------------- reading
    def read(self, ref: Ref) -> Any:
        """One input, trusted only if its bytes hash to what the producer's journal entry says."""
        value = self.run.read_recorded(self.journal, ref)
        if value is None and not (ref.optional and self._producer_done(ref)):
            raise StageFailed(f"input {ref.path} is not ready: stage {ref.producer.id} has not completed; "
                              "run `miniverl resume`")
        return value

    def _producer_done(self, ref: Ref) -> bool:
        record = self.journal.stages.get(ref.producer.id)
        return record is not None and record.state == "done"

    # ---------------------------------------------------------------- running
    def execute(self, key: StageKey) -> None:
        stage = STAGES[key.name]
        for ref in stage.inputs(key, self.recipe).values():  # refused before the record is touched
            if self.journal.is_pruned(ref):
                raise ArtifactPruned(f"stage {key.id} cannot run: its input {pruned_message(ref.path)}")
        record = self.journal.stages.setdefault(key.id, StageRecord())
        before = dict(record.outputs)
        record.state, record.pid, record.started, record.error = "running", os.getpid(), time.time(), None
        record.attempts += 1
        self.run.record(self.journal, key.id)
        self.observer.stage_started(key, record.attempts)
        kill_point(f"{key.id}:start")
        peak = PeakMemory(self.host.device)
        started = time.perf_counter()
        try:
            with peak.track():
                refs = stage.inputs(key, self.recipe)
                got = {name: self.read(ref) for name, ref in refs.items()}
                digests = {name: d for name, ref in refs.items() if (d := self._recorded(ref)) is not None}
                kill_point(f"{key.id}:inputs-read")
                outputs = stage.run(self._context(key, digests), got)
                kill_point(f"{key.id}:computed")
                written = self._write(key, stage, outputs)
        except Exception as exc:
            record.state, record.error = "failed", f"{type(exc).__name__}: {exc}"
            self._record_failure(key, exc)
            if isinstance(exc, MiniverlError):
                raise
            raise StageFailed(f"stage {key.id} failed ({record.error.splitlines()[0][:300]}); details in "
                              f"{self.run.root / layout.ERRORS_LOG}; fix the cause, then "
                              f"`miniverl resume {self.run.root.name}`") from exc
        kill_point(f"{key.id}:before-journal")
        record.state, record.outputs, record.pruned = "done", written, []
        record.summary = next((out.summary for out in outputs if out.summary is not None), None)
        record.inputs = {refs[name].path: digest for name, digest in digests.items()}
        record.seconds, record.peak_memory_bytes = time.perf_counter() - started, peak.allocated
        invalidated = self._invalidate_readers(before, written) if before and before != written else []
        self.run.record(self.journal, *invalidated, key.id)
        self.observer.stage_done(key, record, peak.reserved, self.read, self.journal.stages)
        kill_point(f"{key.id}:journaled")
        if key.name == layout.OPTIMIZER_STEP:
            self.retention.after_step(key.cycle)

    def _context(self, key: StageKey, digests: dict[str, str]) -> StageContext:
        def on_oom_retry(old: int, new: int, error: str | None) -> None:
            self.observer.oom_retry(key, old, new, error)

        return StageContext(key, self.recipe, self.host, self.task, self.reporter, self.run.root.name, digests,
                            self.journal.stages, on_oom_retry, tuple(self.journal.overrides))

    def _write(self, key: StageKey, stage: Stage, outputs: list[Output]) -> dict[str, str]:
        """Write in the order the stage gave (records after the files they name); return path -> sha256."""
        declared = {ref.path: ref for ref in stage.outputs(key, self.recipe)}
        given = [out.ref.path for out in outputs]
        missing = [path for path, ref in declared.items() if not ref.optional and path not in given]
        assert set(given) <= set(declared) and not missing, f"{key.id} broke its output contract: {given}"
        written = {}
        for out in outputs:
            self.run.write_artifact(out.ref.path, out.data, out.sha256)
            kill_point(f"{key.id}:wrote:{out.ref.path}")
            written[out.ref.path] = out.sha256
        return written

    def _invalidate_readers(self, before: dict[str, str], after: dict[str, str]) -> list[str]:
        """The stage rewrote some files with other bytes: the done stages that read them must rerun."""
        changed = {path for path in before.keys() | after.keys() if before.get(path) != after.get(path)}
        pending = []
        for key, record in self.journal.stages.items():
            if record.state == "done" and changed & record.inputs.keys():
                record.state = "pending"
                pending.append(key)
        return pending

    def _record_failure(self, key: StageKey, exc: Exception) -> None:
        """Best effort: the journal and a traceback log; a full disk may refuse both."""
        try:
            self.run.record(self.journal, key.id)
            self.observer.stage_failed(key, str(exc))
            with open(self.run.root / layout.ERRORS_LOG, "a", encoding="utf-8") as log:
                log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {key.id}\n")
                log.write("".join(traceback.format_exception(exc)))
        except OSError:
            pass
