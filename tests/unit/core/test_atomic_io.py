"""Atomic writes: the old bytes or the new ones, never a half; a full disk is one clear error."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from miniverl.engine.core.atomic_io import (
    DiskWriteError, append_line, directory_atomically, sha256_bytes, sha256_file, write_bytes_atomic,
)


def test_write_replaces_whole_and_leaves_no_temporary(tmp_path) -> None:
    path = tmp_path / "deep" / "file.bin"
    write_bytes_atomic(path, b"old")
    write_bytes_atomic(path, b"new bytes")
    assert path.read_bytes() == b"new bytes"
    assert sorted(p.name for p in path.parent.iterdir()) == ["file.bin"]
    assert sha256_file(path) == sha256_bytes(b"new bytes")


def test_a_kill_inside_the_write_leaves_the_old_bytes(tmp_path) -> None:
    """A real SIGKILL after the new bytes are fsynced, before the rename."""
    path = tmp_path / "state.bin"
    write_bytes_atomic(path, b"old")
    code = ("from pathlib import Path; from miniverl.engine.core.atomic_io import write_bytes_atomic; "
            f"write_bytes_atomic(Path({str(path)!r}), b'new')")
    killed = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MINIVERL_FAULT_KILL_AT": "write:state.bin"})
    assert killed.returncode == -9
    assert path.read_bytes() == b"old"


def test_a_full_disk_is_a_disk_write_error_and_cleans_up(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MINIVERL_FAULT_ENOSPC_AT", "full.bin")
    with pytest.raises(DiskWriteError, match="the disk is full") as caught:
        write_bytes_atomic(tmp_path / "full.bin", b"x")
    assert caught.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_append_line_adds_exactly_one_line(tmp_path) -> None:
    path = tmp_path / "events.jsonl"
    append_line(path, "a\n")
    append_line(path, "b")
    assert path.read_text() == "a\nb\n"


# ---------------------------------------------------------------- whole directories
def test_a_directory_appears_whole_and_an_error_leaves_nothing(tmp_path):
    target = tmp_path / "new" / "deeper" / "out"
    with pytest.raises(RuntimeError):
        with directory_atomically(target, replace=False, point="t") as folder:
            (folder / "a").write_text("half")
            raise RuntimeError("the block failed")
    assert list(tmp_path.iterdir()) == []  # no partial folder, and the parents it made are gone too
    with directory_atomically(target, replace=False, point="t") as folder:
        (folder / "a").write_text("whole")
        assert not target.exists()
    assert (target / "a").read_text() == "whole" and sorted(p.name for p in target.parent.iterdir()) == ["out"]


def test_replacing_keeps_the_old_directory_until_the_new_one_is_whole(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old").write_text("old")
    with pytest.raises(FileExistsError):
        with directory_atomically(target, replace=False, point="t") as folder:
            (folder / "new").write_text("new")
    with pytest.raises(RuntimeError):
        with directory_atomically(target, replace=True, point="t") as folder:
            raise RuntimeError("failed before the rename")
    assert [p.name for p in target.iterdir()] == ["old"]
    with directory_atomically(target, replace=True, point="t") as folder:
        (folder / "new").write_text("new")
    assert [p.name for p in target.iterdir()] == ["new"] and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_what_a_dead_process_left_is_removed_and_a_live_ones_is_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".out.partial-{int(dead.stdout)}"
    replaced = tmp_path / f".out.replaced-{int(dead.stdout)}"
    live = tmp_path / f".out.partial-{os.getppid()}"
    for folder in (stale, replaced, live):
        folder.mkdir()
    with directory_atomically(tmp_path / "out", replace=False, point="t") as folder:
        (folder / "a").write_text("a")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live.name])
