"""Live metrics from journal records: each cycle once, in order, across processes; a torn line cut off."""

from __future__ import annotations

import json

import msgspec
import pytest

from support import ROOT
from miniverl.engine.core import layout
from miniverl.engine.core.artifacts import CycleSummary, RolloutSummary, VerifyReport
from miniverl.engine.core.layout import StageKey
from miniverl.engine.core.recipe import parse_recipe, text_with_overrides
from miniverl.engine.core.rundir import RunDir, StageRecord
from miniverl.engine.run.metrics import LiveMetrics, cycle_metrics

CYCLES = 3


def _recipe(*overrides: str):
    text = (ROOT / "recipes" / "tiny_calc.yaml").read_text()
    return parse_recipe(text_with_overrides(text, [f"train.cycles={CYCLES}", *overrides]))


def _done(seconds: float, summary=None) -> StageRecord:
    return StageRecord(state="done", seconds=seconds, peak_memory_bytes=int(seconds * 1000),
                       summary=None if summary is None else msgspec.to_builtins(summary))


def _cycle(records: dict, c: int) -> None:
    records[StageKey(layout.ROLLOUT, c).id] = _done(2.0, RolloutSummary(8, 0.5, 0.25, 400))
    records[StageKey(layout.TEACHER_SCORE, c).id] = _done(0.5)
    records[StageKey(layout.GRADIENT, c).id] = _done(1.0, CycleSummary(c, 1.0 / (c + 1), 0.1 * c, 320, 0.7, 128, 2, []))
    records[StageKey(layout.OPTIMIZER_STEP, c).id] = _done(0.25)


def _verify(label: str) -> VerifyReport:
    return VerifyReport(label=label, policy_adapter_sha256="x", tasks=4, tool_call_rate=1.0, format_validity=1.0,
                        strict_success=0.5 if label == layout.BASELINE else 1.0, items=[])


def _lines(run: RunDir) -> list[dict]:
    return [json.loads(line) for line in (run.root / "metrics.jsonl").read_text().splitlines()]


def test_a_cycle_has_its_figures_once_all_its_stages_are_done():
    records: dict = {}
    _cycle(records, 0)
    del records[StageKey(layout.OPTIMIZER_STEP, 0).id]
    assert cycle_metrics(records, 0) is None
    _cycle(records, 0)
    m = cycle_metrics(records, 0)
    assert (m.loss, m.generated_tokens, m.tokens_per_second, m.cycle_seconds, m.peak_memory_bytes) == (
        1.0, 400, 200.0, 3.75, 2000)
    assert m.seconds == {"rollout": 2.0, "teacher_score": 0.5, "gradient": 1.0, "optimizer_step": 0.25}


def test_each_cycle_and_verify_is_logged_once_in_order_across_processes(tmp_path):
    run = RunDir(tmp_path / "r")
    run.root.mkdir()
    recipe = _recipe()
    records: dict = {}
    first = LiveMetrics(run, recipe)
    first.catch_up(records, _verify)
    assert not (run.root / "metrics.jsonl").exists()
    records[layout.verify_ref(layout.BASELINE).producer.id] = _done(1.0)
    _cycle(records, 0)
    first.catch_up(records, _verify)
    first.catch_up(records, _verify)
    assert [line.get("cycle", line.get("verify")) for line in _lines(run)] == ["baseline", 0]
    with open(run.root / "metrics.jsonl", "a") as handle:
        handle.write('{"cycle": 1, "lo')  # a kill mid-append
    for c in range(1, CYCLES):
        _cycle(records, c)
    records[layout.verify_ref(layout.FINAL).producer.id] = _done(1.0)
    second = LiveMetrics(run, recipe)  # a resumed process
    second.catch_up(records, _verify)
    lines = _lines(run)
    assert [line.get("cycle", line.get("verify")) for line in lines] == ["baseline", 0, 1, 2, "final"]
    assert [line["loss"] for line in lines if "cycle" in line] == [1.0, 0.5, pytest.approx(1 / 3)]
    assert lines[-1] == {"verify": "final", "step": CYCLES, "tasks": 4, "strict_success": 1.0,
                         "tool_call_rate": 1.0, "format_validity": 1.0}


def test_the_final_verify_waits_for_the_last_cycle(tmp_path):
    """Steps only grow: a final verify done out of order (a rerun) is not sent before the cycles."""
    run = RunDir(tmp_path / "r")
    run.root.mkdir()
    records = {layout.verify_ref(label).producer.id: _done(1.0) for label in layout.VERIFY_LABELS}
    _cycle(records, 0)
    LiveMetrics(run, _recipe()).catch_up(records, _verify)
    assert [line.get("cycle", line.get("verify")) for line in _lines(run)] == ["baseline", 0]


def test_tensorboard_points_already_on_disk_are_not_written_again(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    run = RunDir(tmp_path / "r")
    run.root.mkdir()
    recipe = _recipe("report.tensorboard=true")
    records = {layout.verify_ref(layout.BASELINE).producer.id: _done(1.0)}
    _cycle(records, 0)
    live = LiveMetrics(run, recipe)
    live.catch_up(records, _verify)
    live.close()
    (run.root / "metrics.jsonl").unlink()  # as if the ledger had never been written: only the read-back protects
    again = LiveMetrics(run, recipe)
    again.catch_up(records, _verify)
    again.close()
    points = [(v.tag, e.step) for f in sorted((run.root / "tensorboard").glob("events.out.tfevents.*"))
              for e in EventFileLoader(str(f)).Load() for v in e.summary.value]
    assert ("train/loss", 1) in points and ("verify/strict_success", 0) in points
    assert len(points) == len(set(points))
