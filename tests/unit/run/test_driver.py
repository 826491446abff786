"""The generic driver over stand-in stages: which stages run, which are invalidated, what is journaled, what is pruned.

The stand-ins keep every real stage's declared inputs and outputs (the real
layout) but write small JSON documents that name what they read, so the test
sees the whole dependency graph of a two-cycle run without any model.
"""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import pytest

from miniverl.engine.core import layout
from miniverl.engine.core.layout import StageKey
from miniverl.engine.core.progress import Reporter
from miniverl.engine.core.recipe import parse_recipe
from miniverl.engine.core.rundir import Journal, RunDir
from miniverl.engine.run import driver as driver_module
from miniverl.engine.run.driver import Driver
from miniverl.stages.contract import json_output

import yaml

from support import SMALL, recipe_dict


def _as_json(ref: layout.Ref) -> layout.Ref:
    return dataclasses.replace(ref, kind=layout.JSON)


class Standins:
    """One stand-in per real stage; `salt[stage_id]` changes what that stage writes."""

    def __init__(self) -> None:
        self.salt: dict[str, int] = {}
        self.executed: list[str] = []

    def make(self, real) -> types.SimpleNamespace:
        def inputs(key, recipe):
            return {name: _as_json(ref) for name, ref in real.inputs(key, recipe).items()}

        def outputs(key, recipe):
            return [_as_json(ref) for ref in real.outputs(key, recipe)]

        def run(ctx, got):
            self.executed.append(ctx.key.id)
            body = {"stage": ctx.key.id, "read": dict(ctx.digests), "salt": self.salt.get(ctx.key.id, 0)}
            return [json_output(ref, {**body, "file": ref.path})
                    for ref in outputs(ctx.key, ctx.recipe) if not ref.optional]

        return types.SimpleNamespace(NAME=real.NAME, inputs=inputs, outputs=outputs, run=run)


# The dependency-graph tests see every file; the retention tests below use the defaults.
KEEP_ALL = {"artifacts.keep": "all", "checkpoints.keep_last": 1000}


@pytest.fixture
def setup(tmp_path: Path, monkeypatch):
    return _setup(tmp_path, monkeypatch, **KEEP_ALL)


def _setup(tmp_path: Path, monkeypatch, **overrides):
    standins = Standins()
    fake = {name: standins.make(stage) for name, stage in driver_module.STAGES.items()}
    monkeypatch.setattr(driver_module, "STAGES", fake)
    # The observer reads the real artifact types for its console lines; the stand-ins write JSON.
    monkeypatch.setattr(driver_module.Observer, "stage_done", lambda *args: None)
    recipe = parse_recipe(yaml.safe_dump(recipe_dict(**{**SMALL, **overrides})))
    run = RunDir(tmp_path / "run")
    run.root.mkdir(parents=True)
    run.write_journal(Journal(run_id="run"))
    host = types.SimpleNamespace(device="cpu")

    def new_driver() -> Driver:
        return Driver(run, recipe, Reporter(enabled=False), host, types.SimpleNamespace(name="stand-in task"))

    return standins, run, recipe, new_driver


def test_a_run_executes_every_stage_once_in_plan_order(setup) -> None:
    standins, run, recipe, new_driver = setup
    new_driver().run_all()
    assert standins.executed == [k.id for k in layout.plan(recipe.train.cycles)]
    journal = run.read_journal()
    assert all(r.state == "done" for r in journal.stages.values())
    rollout = journal.stages[StageKey(layout.ROLLOUT, 1).id]
    # The journal records the digests of what was read, by path: checkpoint 1 comes from cycle 0's step.
    checkpoint1 = layout.checkpoint_ref(1).path
    assert rollout.inputs[checkpoint1] == journal.stages[StageKey(layout.OPTIMIZER_STEP, 0).id].outputs[checkpoint1]
    standins.executed.clear()
    new_driver().run_all()
    assert standins.executed == []  # nothing to redo


def test_a_changed_output_invalidates_exactly_its_readers(setup) -> None:
    standins, run, recipe, new_driver = setup
    new_driver().run_all()
    standins.executed.clear()
    standins.salt["c000001/rollout"] = 1
    new_driver().execute(StageKey(layout.ROLLOUT, 1))
    states = {k: r.state for k, r in run.read_journal().stages.items()}
    pending = sorted(k for k, s in states.items() if s == "pending")
    # teacher_score and gradient read the rollout; the optimizer step and everything after read neither.
    assert pending == ["c000001/gradient", "c000001/teacher_score"]
    standins.executed.clear()
    new_driver().run_all()
    # The rerun scores give other bytes, so the gradient reruns; its bytes change, so the step,
    # the final verify and the manifest follow; cycle 0 and the baseline are untouched.
    assert standins.executed == ["c000001/teacher_score", "c000001/gradient", "c000001/optimizer_step",
                                 "verify@final", "manifest"]


def test_the_same_bytes_again_invalidate_nothing(setup) -> None:
    standins, run, recipe, new_driver = setup
    new_driver().run_all()
    before = {k: r.outputs for k, r in run.read_journal().stages.items()}
    new_driver().execute(StageKey(layout.GRADIENT, 0))
    journal = run.read_journal()
    assert all(r.state == "done" for r in journal.stages.values())
    assert {k: r.outputs for k, r in journal.stages.items()} == before


def test_a_corrupt_output_is_recomputed_and_a_corrupt_input_refused(setup) -> None:
    standins, run, recipe, new_driver = setup
    new_driver().run_all()
    standins.executed.clear()
    (run.root / layout.rollout_ref(0).path).write_text("{}")
    new_driver().run_all()
    assert standins.executed == ["c000000/rollout"]  # the same bytes again: nothing downstream changes
    # A stage rerun on its own refuses an input whose bytes are not the journaled ones.
    (run.root / layout.rollout_ref(0).path).write_text("{}")
    with pytest.raises(Exception, match="does not match the hash the journal recorded"):
        new_driver().execute(StageKey(layout.TEACHER_SCORE, 0))


def test_an_input_not_yet_written_stops_the_stage(setup) -> None:
    standins, run, recipe, new_driver = setup
    with pytest.raises(Exception, match="is not ready: stage preflight has not completed"):
        new_driver().execute(StageKey(layout.ROLLOUT, 0))
    assert run.read_journal().stages["c000000/rollout"].state == "failed"
    assert json.loads((run.root / layout.EVENTS_FILE).read_text().splitlines()[-1])["event"] == "stage_failed"


# ---------------------------------------------------------------- retention
def _files(run: RunDir) -> set[str]:
    return {str(p.relative_to(run.root)) for p in run.root.rglob("*") if p.is_file() and p.parent != run.root}


def _cycle_files(cycle: int) -> set[str]:
    return {f"{layout.cycle_dir(cycle)}/{name}" for name in ("rollout.msgpack", "teacher_score.msgpack",
                                                             "teacher_score.safetensors", "gradient.msgpack",
                                                             "gradient.safetensors")}


def _checkpoint_files(step: int) -> set[str]:
    # The stand-ins leave out optional outputs (the optimizer state): adapter and record only.
    return {f"{layout.checkpoint_dir(step)}/{name}" for name in ("adapter.safetensors", "checkpoint.msgpack")}


VERIFY_FILES = {"verify/baseline.msgpack", "verify/report.msgpack"}


@pytest.mark.parametrize("overrides,cycles,checkpoints", [
    ({}, [5], [5, 6]),  # the defaults: the last cycle's artifacts, the last two checkpoints
    ({"artifacts.keep": "none"}, [], [5, 6]),
    ({"checkpoints.keep_last": 1, "checkpoints.keep_every": 2}, [5], [0, 2, 4, 6]),
    ({"artifacts.keep": "all", "checkpoints.keep_last": 3}, [0, 1, 2, 3, 4, 5], [4, 5, 6]),
])
def test_retention_keeps_what_the_recipe_asks_and_the_rest_counts_as_done(tmp_path, monkeypatch, overrides, cycles,
                                                                          checkpoints) -> None:
    standins, run, recipe, new_driver = _setup(tmp_path, monkeypatch, **{"train.cycles": 6, **overrides})
    new_driver().run_all()
    expected = VERIFY_FILES | {p for c in cycles for p in _cycle_files(c)}
    expected |= {p for step in checkpoints for p in _checkpoint_files(step)}
    assert _files(run) == expected
    journal = run.read_journal()
    for c in set(range(6)) - set(cycles):
        assert set(journal.stages[StageKey(layout.GRADIENT, c).id].pruned) == {p for p in _cycle_files(c) if "gradient" in p}
    standins.executed.clear()
    new_driver().run_all()
    assert standins.executed == []  # removed on purpose is not missing: nothing reruns


def test_disk_use_is_flat_in_the_number_of_cycles(tmp_path, monkeypatch) -> None:
    counts = {}
    for cycles in (5, 60):
        standins, run, recipe, new_driver = _setup(tmp_path / str(cycles), monkeypatch, **{"train.cycles": cycles})
        new_driver().run_all()
        counts[cycles] = (len(_files(run)), len(list(run.root.rglob("*"))))
    assert counts[5] == counts[60]


def test_a_stage_whose_inputs_were_pruned_is_refused_before_its_record_changes(setup, tmp_path, monkeypatch) -> None:
    standins, run, recipe, new_driver = _setup(tmp_path / "d", monkeypatch)
    new_driver().run_all()
    before = run.read_journal()
    with pytest.raises(Exception, match="cycles/000000/rollout.msgpack was removed by the run's retention policy.*"
                                        "artifacts.keep: all"):
        new_driver().execute(StageKey(layout.TEACHER_SCORE, 0))
    assert run.read_journal() == before


def test_a_kill_between_the_prune_record_and_the_removal_loses_nothing(tmp_path, monkeypatch) -> None:
    """The journal says pruned, the files are still there: the next process removes them, and reruns nothing."""
    from miniverl.engine.run import retention

    standins, run, recipe, new_driver = _setup(tmp_path, monkeypatch, **{"train.cycles": 3})

    class Killed(BaseException):
        pass

    real_remove = retention.Retention._remove

    def die(self, paths):
        if paths:
            raise Killed
    monkeypatch.setattr(retention.Retention, "_remove", die)
    with pytest.raises(Killed):
        new_driver().run_all()
    assert all((run.root / p).exists() for p in _checkpoint_files(0))  # journaled as pruned, not yet removed
    assert layout.checkpoint_ref(0).path in run.read_journal().stages["preflight"].pruned
    monkeypatch.setattr(retention.Retention, "_remove", real_remove)
    standins.executed.clear()
    new_driver().run_all()
    assert not any((run.root / p).exists() for p in _checkpoint_files(0))
    assert "c000000/rollout" not in standins.executed and standins.executed[-1] == "manifest"


def test_a_corrupt_file_that_cannot_be_remade_and_is_not_needed_is_dropped(tmp_path, monkeypatch) -> None:
    standins, run, recipe, new_driver = _setup(tmp_path, monkeypatch, **{"train.cycles": 4})
    new_driver().run_all()
    spare = layout.checkpoint_ref(3).path  # kept (the last two), made from cycle 2's gradient, which is pruned
    (run.root / spare).write_text("{}")
    standins.executed.clear()
    new_driver().run_all()
    assert standins.executed == []
    assert spare in run.read_journal().stages["c000002/optimizer_step"].pruned and not (run.root / spare).exists()
