"""Crash-safe file writes: temp file in the same directory, fsync, rename, fsync dir.

Whole directories (an exported adapter) are filled under a temporary name and renamed the same way.

A crash at any instant leaves either the old file or the new one. Disk-full
and other OS errors surface as `DiskWriteError` naming the path, after the
temporary file is removed, so a full disk never leaves half a file behind.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from miniverl.engine.core.errors import MiniverlError
from miniverl.engine.core.faults import disk_fault, kill_point


class DiskWriteError(MiniverlError, OSError):
    """Writing state failed (e.g. disk full); the previous state is intact."""

    exit_code = 1


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    _fsync(directory)


def truncate_file(path: Path, length: int) -> None:
    """Cut a file to `length` bytes, durably (a torn tail left by a killed appender)."""
    with open(path, "r+b") as handle:
        handle.truncate(length)
        os.fsync(handle.fileno())


def write_bytes_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            disk_fault(path.name)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        kill_point(f"write:{path.name}")  # the new bytes are on disk, not yet in place
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        hint = " (the disk is full: free space, then `miniverl resume`)" if exc.errno == errno.ENOSPC else ""
        raise DiskWriteError(exc.errno or 0, f"could not write {path}: {exc.strerror or exc}{hint}") from exc


def append_line(path: Path, line: str) -> None:
    """Append one line (events log); a torn last line is tolerated by readers."""
    try:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(line.rstrip("\n") + "\n")
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        raise DiskWriteError(exc.errno or 0, f"could not append to {path}: {exc.strerror or exc}") from exc


# ---------------------------------------------------------------- whole directories
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: alive, someone else's
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _sync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            _fsync(Path(folder) / name)
        fsync_dir(Path(folder))


@contextmanager
def directory_atomically(target: Path, replace: bool, point: str) -> Iterator[Path]:
    """A temporary sibling folder to fill; once the block ends, it is synced and renamed to `target` whole.

    A kill at any instant leaves no `target` (or the old one) or the complete new one: the
    folder is filled as `.NAME.partial-PID` and renamed; with `replace`, the old `target` is first
    renamed to `.NAME.replaced-PID`. The next call for the same target removes what dead
    processes left. An error in the block removes the partial folder and any parents this
    call created. Kill points: `POINT:filled`, `POINT:old-moved`, `POINT:renamed`.
    """
    parent = target.parent
    created = [p for p in (parent, *parent.parents) if not p.exists()]
    parent.mkdir(parents=True, exist_ok=True)
    for leftover in [*parent.glob(f".{target.name}.partial-*"), *parent.glob(f".{target.name}.replaced-*")]:
        pid = leftover.name.rpartition("-")[2]
        if not pid.isdigit() or not _alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)
    partial = parent / f".{target.name}.partial-{os.getpid()}"
    old = parent / f".{target.name}.replaced-{os.getpid()}"
    try:
        partial.mkdir()
        yield partial
        _sync_tree(partial)
        kill_point(f"{point}:filled")
        if target.exists():
            if not replace:
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
            os.replace(target, old)
            kill_point(f"{point}:old-moved")
        os.replace(partial, target)
        fsync_dir(parent)
        kill_point(f"{point}:renamed")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        if old.exists() and not target.exists():
            os.replace(old, target)  # the old folder back where it was
        for folder in created:  # innermost first; stops at the first one that is not empty
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    shutil.rmtree(old, ignore_errors=True)
