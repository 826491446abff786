"""Crash-safe file writes: temp file in the same directory, fsync, rename, fsync dir.

A crash at any instant leaves either the old file or the new one. Disk-full
and other OS errors surface as `DiskWriteError` naming the path, after the
temporary file is removed, so a full disk never leaves half a file behind.
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

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


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
