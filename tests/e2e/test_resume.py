"""Resume after a real SIGKILL inside every stage gives the uninterrupted result, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

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
    "metrics:sent#2",  # cycle 0's TensorBoard points flushed, its metrics.jsonl line not yet written
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
    "calculator": recipe_dict(**SMALL, **{"report.tensorboard": True}),
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
    _assert_each_point_once(runs / "r", manifest(runs, "r"))


def _tensorboard_points(run: Path) -> list[tuple[str, int, float]]:
    """Every scalar in the run's event files, read with tensorboard's own reader."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util.tensor_util import make_ndarray

    points = []
    for file in sorted((run / "tensorboard").glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(file)).Load():  # the loader turns simple values into tensors
            points += [(v.tag, event.step, float(make_ndarray(v.tensor))) for v in event.summary.value]
    return points


def _assert_each_point_once(run: Path, document: dict) -> None:
    """metrics.jsonl: one line per cycle and per verify; TensorBoard (when asked for): each (tag, step) once."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    cycles = len(document["cycles"])
    assert [line["cycle"] for line in lines if "cycle" in line] == list(range(cycles))
    assert [line["verify"] for line in lines if "verify" in line] == ["baseline", "final"]
    for line, expected in zip([line for line in lines if "cycle" in line], document["cycles"]):
        assert (line["loss"], line["kl"], line["grad_norm"]) == (expected["loss"], expected["kl"], expected["grad_norm"])
        assert set(line["seconds"]) == {"rollout", "teacher_score", "gradient", "optimizer_step"}
    if not document["recipe"]["report"]["tensorboard"]:
        return
    points = _tensorboard_points(run)
    keys = [(tag, step) for tag, step, _ in points]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)[:5]
    losses = {step: value for tag, step, value in points if tag == "train/loss"}
    assert sorted(losses) == list(range(1, cycles + 1))  # step k: the policy after k updates
    for c in document["cycles"]:
        assert losses[c["cycle"] + 1] == pytest.approx(c["loss"], rel=1e-6)  # stored as float32
    success = {step: value for tag, step, value in points if tag == "verify/strict_success"}
    assert success == pytest.approx({0: document["verify_baseline"]["strict_success"],
                                     cycles: document["verify"]["strict_success"]})


def test_tensorboard_has_cycle_1_while_the_run_goes_and_each_point_once_after_resume(reference, tmp_path):
    recipe, expected = reference
    runs = tmp_path / "runs"
    killed = miniverl("run", str(recipe), "--run-id", "r", "--runs-dir", str(runs),
                      env={"MINIVERL_FAULT_KILL_AT": "c000001/rollout:start"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    # Cycle 1 (index 0) is done and the run is still going: its points are already on disk.
    steps = {(tag, step) for tag, step, _ in _tensorboard_points(runs / "r")}
    assert {("train/loss", 1), ("rollout/tool_call_rate", 1), ("time/cycle_seconds", 1),
            ("verify/strict_success", 0)} <= steps
    assert not any(step > 1 for _, step in steps)
    ledger = (runs / "r" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line).get("cycle", "verify") for line in ledger] == ["verify", 0]
    with open(runs / "r" / "metrics.jsonl", "a") as handle:
        handle.write('{"cycle": 1, "loss"')  # a line torn by a kill mid-append
    resumed = miniverl("resume", "r", "--runs-dir", str(runs))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    document = manifest(runs, "r")
    assert _comparable(document) == _comparable(expected)
    _assert_each_point_once(runs / "r", document)
    assert miniverl("report", "r", "--runs-dir", str(runs)).returncode == 0  # `report` adds no second copy
    _assert_each_point_once(runs / "r", document)


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.mark.skipif(not _installed("wandb"), reason="the optional wandb package is not installed")
def test_wandb_offline_logs_every_cycle_and_a_resume_sends_nothing_twice(tmp_path):
    """With wandb installed (`pip install miniverl[wandb]`), offline mode needs no network or account."""
    recipe = write_recipe(tmp_path, recipe_dict(**SMALL, **{"report.wandb": {"project": "miniverl-test",
                                                                             "mode": "offline"}}))
    runs = tmp_path / "runs"
    env = {"WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    done = miniverl("run", str(recipe), "--run-id", "r", "--runs-dir", str(runs), env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    logs = sorted((runs / "r" / "wandb").glob("offline-run-*-r/run-r.wandb"))  # the run id is the wandb id
    assert len(logs) == 1
    data = logs[0].read_bytes()
    for tag in (b"train/loss", b"rollout/tool_call_rate", b"time/cycle_seconds", b"verify/strict_success"):
        assert tag in data, tag
    again = miniverl("resume", "r", "--runs-dir", str(runs), env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    _assert_each_point_once(runs / "r", manifest(runs, "r"))
    assert len(list((runs / "r" / "wandb").glob("offline-run-*-r"))) == 1  # nothing new to send: no second run


def test_resume_of_a_finished_run_changes_nothing(reference, tmp_path):
    recipe, expected = reference
    runs = tmp_path / "runs"
    assert miniverl("run", str(recipe), "--run-id", "r", "--runs-dir", str(runs)).returncode == 0
    before = (runs / "r" / "manifest.json").read_bytes()
    again = miniverl("resume", "r", "--runs-dir", str(runs))
    assert again.returncode == 0, again.stderr
    assert (runs / "r" / "manifest.json").read_bytes() == before
    assert _comparable(manifest(runs, "r")) == _comparable(expected)
