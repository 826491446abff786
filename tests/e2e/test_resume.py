"""Resume after a real SIGKILL inside every stage gives the uninterrupted result, bit for bit."""

from __future__ import annotations

import pytest

from support import ROOT, SMALL, manifest, miniverl, recipe_dict, write_recipe

# One kill point inside each of the seven stages (the driver's `ID:start`,
# `ID:inputs-read`, `ID:computed`, `ID:wrote:PATH` after each output file); the
# instants between a stage's outputs and its journal entry; and inside the writes
# of every kind of file (`write:NAME[#K]`: the K-th write of NAME is killed after
# its new bytes are fsynced to the temporary file, before the rename); and the
# journal's own writes (a torn record, the snapshot rewrite); and the retention
# pass that removes checkpoint 0 and cycle 0 once checkpoint 2 is durable.
KILL_POINTS = [
    "preflight:start",
    "preflight:wrote:checkpoints/000000/adapter.safetensors",
    "verify@baseline:start",
    "c000000/rollout:start",
    "c000000/rollout:before-journal",
    "c000000/teacher_score:start",
    "c000001/teacher_score:before-journal",
    "c000000/gradient:inputs-read",
    "c000001/gradient:before-journal",
    "c000000/optimizer_step:computed",
    "c000001/optimizer_step:wrote:checkpoints/000002/adapter.safetensors",
    "c000001/optimizer_step:before-journal",
    "c000001/optimizer_step:journaled",  # checkpoint 2 durable, checkpoint 0 and cycle 0 not yet pruned
    "prune:journaled",  # their removal journaled, the files still there
    "prune:removed:checkpoints/000000/adapter.safetensors",  # inside the removal
    "verify@final:start",
    "manifest:start",
    "manifest:before-journal",
    "write:resolved.json",
    "write:preflight.msgpack",
    "write:journal.msgpack#2",  # the journal's snapshot rewrite (the first write creates the run)
    "journal:snapshot-written",  # the new snapshot in place, the log not yet emptied
    "tear:journal.log#5",  # half a journal record on disk (a stage's start)
    "tear:journal.log#22",  # ... and a stage's done record
    "write:baseline.msgpack",
    "write:rollout.msgpack#2",
    "write:teacher_score.safetensors",
    "write:teacher_score.msgpack#2",
    "write:gradient.safetensors#2",
    "write:gradient.msgpack",
    "write:adapter.safetensors#2",
    "write:optimizer.safetensors#2",
    "write:checkpoint.msgpack#3",
    "write:report.msgpack",
    "write:manifest.json",
]

METRICS = ("adapter_sha256",)
# The other tasks go through the same driver; a kill inside each stage of theirs, and
# inside the task-file copies a jsonl run takes, must resume to the same bits too.
OTHER_TASK_KILL_POINTS = [
    "preflight:computed",
    "c000000/rollout:computed",
    "c000001/teacher_score:start",
    "c000000/gradient:before-journal",
    "c000001/optimizer_step:computed",
    "verify@final:computed",
]
EXAMPLES = ROOT / "recipes" / "examples"
TASK_RECIPES = {
    "calculator": recipe_dict(**SMALL),
    "sql": recipe_dict("tiny_sql.yaml", **SMALL),
    "jsonl": recipe_dict("tiny_jsonl_example.yaml", **SMALL, **{
        "task.path": str(EXAMPLES / "arithmetic.jsonl"), "task.tools": str(EXAMPLES / "arithmetic_tools.py")}),
}


def _reference(tmp_path_factory, task: str):
    tmp = tmp_path_factory.mktemp(f"reference-{task}")
    recipe = write_recipe(tmp, TASK_RECIPES[task])
    done = miniverl("run", str(recipe), "--run-id", "ref", "--runs-dir", str(tmp / "runs"))
    assert done.returncode == 0, done.stderr
    return recipe, manifest(tmp / "runs", "ref")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _reference(tmp_path_factory, "calculator")


@pytest.fixture(scope="module", params=["sql", "jsonl"])
def other_reference(request, tmp_path_factory):
    return _reference(tmp_path_factory, request.param)


def _comparable(document: dict) -> dict:
    return {
        "adapter_sha256": document["adapter_sha256"],
        "cycles": [{k: c[k] for k in ("loss", "kl", "positions", "grad_norm")} for c in document["cycles"]],
        "verify": document["verify"],
        "verify_baseline": document["verify_baseline"],
        "quality_gate": document["quality_gate"],
    }


@pytest.mark.slow
@pytest.mark.parametrize("point", KILL_POINTS)
def test_sigkill_then_resume_is_bit_identical(point, reference, tmp_path):
    _kill_and_resume(point, reference, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("point", OTHER_TASK_KILL_POINTS)
def test_sigkill_then_resume_is_bit_identical_for_the_other_tasks(point, other_reference, tmp_path):
    _kill_and_resume(point, other_reference, tmp_path)


@pytest.mark.slow
def test_a_kill_while_the_run_is_created_leaves_a_run_that_starts_again(tmp_path_factory, tmp_path):
    """Killed while copying the task files, before the journal exists: `run` with the same id starts afresh."""
    recipe, expected = _reference(tmp_path_factory, "jsonl")
    runs = tmp_path / "runs"
    killed = miniverl("run", str(recipe), "--run-id", "r", "--runs-dir", str(runs),
                      env={"MINIVERL_FAULT_KILL_AT": "write:tools.py"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = miniverl("resume", "r", "--runs-dir", str(runs))
    assert resumed.returncode == 2 and "start it again" in resumed.stderr, resumed.stderr
    again = miniverl("run", str(recipe), "--run-id", "r", "--runs-dir", str(runs))
    assert again.returncode == 0, again.stderr[-2000:]
    assert _comparable(manifest(runs, "r")) == _comparable(expected)


def _kill_and_resume(point, reference, tmp_path):
    recipe, expected = reference
    runs = tmp_path / "runs"
    killed = miniverl("run", str(recipe), "--run-id", "r", "--runs-dir", str(runs),
                      env={"MINIVERL_FAULT_KILL_AT": point})
    assert killed.returncode == -9, f"the kill point {point} was never reached:\n{killed.stderr[-2000:]}"
    assert not (runs / "r" / "manifest.json").exists() or point.startswith("manifest:before")
    resumed = miniverl("resume", "r", "--runs-dir", str(runs))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _comparable(manifest(runs, "r")) == _comparable(expected)


def test_resume_of_a_finished_run_changes_nothing(reference, tmp_path):
    recipe, expected = reference
    runs = tmp_path / "runs"
    assert miniverl("run", str(recipe), "--run-id", "r", "--runs-dir", str(runs)).returncode == 0
    before = (runs / "r" / "manifest.json").read_bytes()
    again = miniverl("resume", "r", "--runs-dir", str(runs))
    assert again.returncode == 0, again.stderr
    assert (runs / "r" / "manifest.json").read_bytes() == before
    assert _comparable(manifest(runs, "r")) == _comparable(expected)
