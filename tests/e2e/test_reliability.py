"""Corrupt artifacts, a full disk, concurrent writers: detected, reported, recovered."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import ROOT, SMALL, manifest, miniverl, recipe_dict, write_recipe


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# Every file kept, so that each kind can be corrupted; what retention changes is tested below.
KEEP_ALL = {"artifacts.keep": "all", "checkpoints.keep_every": 1}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("finished")
    recipe = write_recipe(tmp, recipe_dict(**SMALL, **KEEP_ALL))
    result = miniverl("run", str(recipe), "--run-id", "ref", "--runs-dir", str(tmp / "runs"))
    assert result.returncode == 0, result.stderr
    return recipe, tmp / "runs" / "ref"


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 3)])


CORRUPTIONS = [
    ("cycles/000000/rollout.msgpack", _flip_byte),
    ("cycles/000000/teacher_score.safetensors", _truncate),
    ("cycles/000001/gradient.safetensors", lambda p: p.unlink()),
    ("cycles/000001/gradient.msgpack", _flip_byte),
    ("checkpoints/000001/adapter.safetensors", _flip_byte),
    ("checkpoints/000002/optimizer.safetensors", _truncate),
    ("checkpoints/000000/checkpoint.msgpack", lambda p: p.unlink()),
    ("preflight.msgpack", _flip_byte),
    ("verify/report.msgpack", _truncate),
    ("manifest.json", lambda p: p.unlink()),
]


@pytest.mark.parametrize("relative,corrupt", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_corrupt_file_is_detected_and_recomputed(finished, tmp_path, relative, corrupt):
    import shutil

    _, reference = finished
    run = tmp_path / "runs" / "ref"
    shutil.copytree(reference, run)
    original = _sha(reference / relative)
    corrupt(run / relative)
    result = miniverl("resume", "ref", "--runs-dir", str(tmp_path / "runs"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "recomputing" in result.stderr
    if relative != "manifest.json":  # the manifest carries wall-clock timings
        assert _sha(run / relative) == original  # recomputed byte for byte
    assert manifest(tmp_path / "runs", "ref")["adapter_sha256"] == manifest(reference.parent, "ref")["adapter_sha256"]


def test_with_retention_a_kept_file_is_recomputed_and_one_that_cannot_be_remade_is_dropped(finished, tmp_path):
    """Defaults: cycle 1's artifacts and checkpoints 1-2 kept; checkpoint 1 came from cycle 0's pruned gradient."""
    recipe, reference = finished
    runs = tmp_path / "runs"
    plain = write_recipe(tmp_path, recipe_dict(**SMALL))
    assert miniverl("run", str(plain), "--run-id", "r", "--runs-dir", str(runs)).returncode == 0
    run = runs / "r"
    assert not (run / "cycles/000000").exists() and not (run / "checkpoints/000000").exists()
    kept, spare = run / "cycles/000001/gradient.msgpack", run / "checkpoints/000001/adapter.safetensors"
    original = _sha(kept)
    _flip_byte(kept)
    result = miniverl("resume", "r", "--runs-dir", str(runs))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "recomputing c000001/gradient" in result.stderr and _sha(kept) == original
    # Without its pruned inputs the spare checkpoint cannot be remade; nothing still to run needs it.
    _flip_byte(spare)
    result = miniverl("resume", "r", "--runs-dir", str(runs))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "cannot be remade" in result.stderr and not spare.exists()
    assert manifest(runs, "r")["adapter_sha256"] == manifest(reference.parent, "ref")["adapter_sha256"]
    # A removed artifact is named as removed, with the key that keeps it: one line, exit 2, the run untouched.
    journal = (run / "journal.log").read_bytes()
    for args, key in ((("inspect", "r", "rollout", "--cycle", "0"), "artifacts.keep: all"),
                      (("stage", "r", "gradient", "--cycle", "0"), "artifacts.keep: all"),
                      (("stage", "r", "rollout", "--cycle", "0"), "checkpoints.keep_every")):
        refused = miniverl(*args, "--runs-dir", str(runs))
        lines = [line for line in refused.stderr.splitlines() if line.strip()]
        assert refused.returncode == 2 and len(lines) == 1 and "removed by the run's retention policy" in lines[0], \
            refused.stderr
        assert key in lines[0]
    assert (run / "journal.log").read_bytes() == journal


def test_disk_full_stops_cleanly_and_resume_completes(finished, tmp_path):
    recipe, reference = finished
    runs = tmp_path / "runs"
    full = miniverl("run", str(recipe), "--run-id", "r", "--runs-dir", str(runs),
                    env={"MINIVERL_FAULT_ENOSPC_AT": "gradient.safetensors#2"})
    assert full.returncode == 1
    assert "disk is full" in full.stderr and "Traceback" not in full.stderr
    # The previous state is intact: nothing half-written, cycle 0 done, cycle 1's gradient not.
    assert not list((runs / "r").rglob(".*.tmp-*"))
    assert not (runs / "r" / "cycles/000001/gradient.safetensors").exists()
    assert (runs / "r" / "checkpoints/000001/checkpoint.msgpack").exists()
    resumed = miniverl("resume", "r", "--runs-dir", str(runs))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert manifest(runs, "r")["adapter_sha256"] == manifest(reference.parent, "ref")["adapter_sha256"]


def test_second_writer_is_refused_and_a_dead_holders_lock_is_recovered(tmp_path):
    # A run long enough to still hold its lock while the second writers knock.
    recipe = write_recipe(tmp_path, recipe_dict(**{**SMALL, "train.cycles": 500, **KEEP_ALL}))
    runs = tmp_path / "runs"
    env = {**os.environ, "MINIVERL_FAULT_KILL_AT": ""}
    first = subprocess.Popen([sys.executable, "-m", "miniverl.engine.cli.app", "run", str(recipe), "--run-id", "r",
                              "--runs-dir", str(runs)], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (runs / "r" / "cycles" / "000000" / "rollout.msgpack").exists() and time.time() < deadline:
            assert first.poll() is None, "the first run ended early"
            time.sleep(0.2)
        for args in (("resume", "r"), ("stage", "r", "rollout", "--cycle", "0")):
            second = miniverl(*args, "--runs-dir", str(runs))
            assert second.returncode == 2, second.stderr
            assert f"pid {first.pid}" in second.stderr
        assert first.poll() is None, "the first run must have held the lock throughout"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # The kernel released the dead holder's flock: the next writer just takes it.
    again = miniverl("stage", "r", "rollout", "--cycle", "0", "--runs-dir", str(runs))
    assert again.returncode == 0, again.stderr[-2000:]
