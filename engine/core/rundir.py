"""The run directory: journal, lock, events, and where each artifact lives.

The journal is the source of truth for resume. A stage is `done` only once
its outputs are on disk (each written atomically) and the journal entry that
names their hashes has been written after them, atomically too. The lock is
an OS file lock (released by the kernel when its holder dies, so a stale lock
cannot outlive a killed process); the holder's pid sits beside it for the
error message.
"""

from __future__ import annotations

import json
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import filelock
import msgspec

from miniverl.engine.core import layout
from miniverl.engine.core.artifacts import Manifest, decode_manifest, read_artifact, read_tensors_file
from miniverl.engine.core.atomic_io import append_line, sha256_bytes, write_bytes_atomic
from miniverl.engine.core.errors import ArtifactError, RunStateError

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


class StageRecord(msgspec.Struct):
    state: str = "pending"  # pending | running | done | failed
    pid: int | None = None
    started: float | None = None
    seconds: float | None = None
    peak_memory_bytes: int | None = None
    outputs: dict[str, str] = msgspec.field(default_factory=dict)  # relative path -> sha256
    inputs: dict[str, str] = msgspec.field(default_factory=dict)  # relative path -> sha256 when read
    attempts: int = 0
    error: str | None = None


class Journal(msgspec.Struct):
    run_id: str
    stages: dict[str, StageRecord] = msgspec.field(default_factory=dict)


def check_run_id(run_id: str) -> str:
    if not RUN_ID_RE.match(run_id) or ".." in run_id:
        raise RunStateError(
            f"run id {run_id!r} is not allowed: use letters, digits, '.', '_' or '-' (no '/' or '..')"
        )
    return run_id


class RunDir:
    def __init__(self, root: Path):
        self.root = root
        self.journal_path = root / layout.JOURNAL_FILE
        self.events_path = root / layout.EVENTS_FILE
        self._lock = filelock.FileLock(str(root / layout.LOCK_FILE), timeout=0)

    @staticmethod
    def locate(runs_dir: Path, run_id: str) -> "RunDir":
        return RunDir(runs_dir / check_run_id(run_id))

    def exists(self) -> bool:
        return self.journal_path.exists()

    # ------------------------------------------------------------- locking
    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the run for writing; refuse at once if another process holds it."""
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire()
        except filelock.Timeout:
            holder = self._holder_pid()
            raise RunStateError(
                f"run {self.root.name} is in use by another miniverl process (pid {holder}); "
                "wait for it to finish or stop it"
            ) from None
        try:
            write_bytes_atomic(self.root / layout.LOCK_PID_FILE, str(os.getpid()).encode())
            yield
        finally:
            self._lock.release()

    def _holder_pid(self) -> str:
        try:
            return (self.root / layout.LOCK_PID_FILE).read_text().strip() or "unknown"
        except OSError:
            return "unknown"

    # ------------------------------------------------------------- journal
    def read_journal(self) -> Journal:
        try:
            return msgspec.msgpack.decode(self.journal_path.read_bytes(), type=Journal)
        except FileNotFoundError:
            raise RunStateError(f"{self.root} is not a miniverl run (no journal); check the run id") from None
        except msgspec.DecodeError:
            raise RunStateError(f"{self.journal_path} is unreadable; the run cannot be resumed") from None

    def write_journal(self, journal: Journal) -> None:
        write_bytes_atomic(self.journal_path, msgspec.msgpack.encode(journal))

    # ------------------------------------------------------------- events
    def event(self, kind: str, **fields: object) -> None:
        record = {"time": round(time.time(), 3), "event": kind, **fields}
        append_line(self.events_path, json.dumps(record, sort_keys=True, default=str))

    def read_events(self) -> list[dict]:
        events = []
        try:
            lines = self.events_path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return events
        for line in lines:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line from a killed process
        return events

    # ------------------------------------------------------------- artifacts
    def read_recorded(self, journal: Journal, ref: layout.Ref) -> Any:
        """The artifact `ref` names if its producer is done and recorded it, else None.

        The bytes must hash to what the journal recorded (ArtifactError otherwise).
        """
        record = journal.stages.get(ref.producer.id)
        if record is None or record.state != "done" or ref.path not in record.outputs:
            return None
        path, digest = self.root / ref.path, record.outputs[ref.path]
        if ref.kind == layout.TENSORS:
            return read_tensors_file(path, digest)
        if ref.kind == layout.JSON:
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                raise ArtifactError(f"{path}: missing") from None
            if sha256_bytes(data) != digest:
                raise ArtifactError(f"{path}: does not match the hash the journal recorded (corrupt or replaced)")
            return json.loads(data)
        return read_artifact(path, ref.kind, digest)

    # ------------------------------------------------------------- manifest
    def read_manifest(self) -> Manifest | None:
        """The terminal manifest, once the run has one (None before, or if it is unreadable)."""
        try:
            return decode_manifest((self.root / layout.MANIFEST_FILE).read_bytes())
        except (OSError, msgspec.DecodeError):
            return None
