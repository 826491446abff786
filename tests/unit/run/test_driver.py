"""The generic driver over stand-in stages: which stages run, which are invalidated, what is journaled.

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


@pytest.fixture
def setup(tmp_path: Path, monkeypatch):
    standins = Standins()
    fake = {name: standins.make(stage) for name, stage in driver_module.STAGES.items()}
    monkeypatch.setattr(driver_module, "STAGES", fake)
    # The observer reads the real artifact types for its console lines; the stand-ins write JSON.
    monkeypatch.setattr(driver_module.Observer, "stage_done", lambda *args: None)
    recipe = parse_recipe(yaml.safe_dump(recipe_dict(**SMALL)))
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
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
