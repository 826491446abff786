"""The run directory: journal, lock, events, and where each artifact lives.

The journal is the source of truth for resume. A stage is `done` only once
its outputs are on disk (each written atomically) and the journal record that
names their hashes has been appended after them. The lock is an OS file lock
(released by the kernel when its holder dies, so a stale lock cannot outlive a
killed process); the holder's pid sits beside it for the error message.

The journal is a snapshot plus an append-only log, so recording a stage costs
the same at cycle 5,000 as at cycle 1:

    journal.msgpack  Journal: every stage record, through log record `seq` (written atomically)
    journal.log      frames of [u32 length][u32 crc32][msgpack Update]; each Update sets some stage
                     records at once and carries the next `seq`

Reading replays the log's updates above the snapshot's `seq` and stops at the
first frame that is short or fails its checksum: the torn tail of a process
killed mid-append (the writer cuts it off before appending again). Every so
often the whole journal is written as a new snapshot and the log emptied; a
kill between the two leaves updates the snapshot already holds, which replay
skips by their `seq`. A snapshot is written once the log has grown as large
as the last one, so snapshots never cost more bytes than the appends did: O(1)
per stage on average, and a reader never replays more than a snapshot's size.
"""

from __future__ import annotations

import json
import os
import re
import struct
import time
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, TypeVar

import filelock
import msgspec

from miniverl.engine.core import layout
from miniverl.engine.core.artifacts import Manifest, decode_manifest, read_artifact, read_tensors_file
from miniverl.engine.core.atomic_io import DiskWriteError, append_line, sha256_bytes, truncate_file, write_bytes_atomic
from miniverl.engine.core.errors import ArtifactError, ArtifactPruned, RunStateError
from miniverl.engine.core.faults import kill_point, tear_point

S = TypeVar("S")
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
    pruned: list[str] = msgspec.field(default_factory=list)  # outputs the retention policy removed since
    summary: dict[str, Any] | None = None  # the stage's headline figures, kept after its files are pruned

    def summary_as(self, kind: type[S]) -> S | None:
        """The summary as the Struct the stage left it as, once the stage is done."""
        return msgspec.convert(self.summary, kind) if self.state == "done" and self.summary is not None else None


class Journal(msgspec.Struct):
    run_id: str
    stages: dict[str, StageRecord] = msgspec.field(default_factory=dict)
    seq: int = 0  # the last log update this journal holds
    overrides: list[str] = msgspec.field(default_factory=list)  # `key=value` items `run` applied to the recipe file

    def is_pruned(self, ref: layout.Ref) -> bool:
        """Whether the retention policy removed the artifact `ref` names."""
        record = self.stages.get(ref.producer.id)
        return record is not None and ref.path in record.pruned


class Update(msgspec.Struct):
    """One log record: these stage records, as they now stand."""

    seq: int
    stages: dict[str, StageRecord]


_FRAME = struct.Struct("<II")  # payload length, crc32 of the payload
SNAPSHOT_MIN_BYTES = 4096  # a new snapshot once the log holds max(this, the snapshot's size) bytes
_update_encoder = msgspec.msgpack.Encoder()
_update_decoder = msgspec.msgpack.Decoder(Update)


def _frame(update: Update) -> bytes:
    payload = _update_encoder.encode(update)
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def _updates(data: bytes) -> tuple[list[Update], int]:
    """The log's whole frames, and the byte length they fill (the rest is a torn tail)."""
    updates, at = [], 0
    while at + _FRAME.size <= len(data):
        length, crc = _FRAME.unpack_from(data, at)
        payload = data[at + _FRAME.size: at + _FRAME.size + length]
        if len(payload) < length or zlib.crc32(payload) != crc:
            break
        try:
            updates.append(_update_decoder.decode(payload))
        except msgspec.DecodeError:
            break
        at += _FRAME.size + length
    return updates, at


def pruned_message(path: str) -> str:
    """Why an artifact is gone, and which recipe key keeps it in the next run."""
    if path.startswith("checkpoints/"):
        keep = "a larger checkpoints.keep_last or checkpoints.keep_every: K keeps more checkpoints"
    else:
        keep = "artifacts.keep: all keeps every cycle's rollout, teacher scores and gradient"
    return f"{path} was removed by the run's retention policy once a later checkpoint was durable; in a next run, {keep}"


def _signature(path: Path) -> tuple[int, int, int, int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


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
        self.log_path = root / layout.JOURNAL_LOG
        self._log_bytes = 0  # the log's length and the snapshot's, as this writer knows them
        self._snapshot_bytes = 0
        self.events_path = root / layout.EVENTS_FILE
        self._lock = filelock.FileLock(str(root / layout.LOCK_FILE), timeout=0)
        # path -> (the file's identity and times after this process wrote it, the sha256 of those bytes)
        self._written: dict[str, tuple[tuple[int, int, int, int, int], str]] = {}

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
        """The snapshot with the log's whole updates applied (safe while another process appends)."""
        return self._load()[0]

    def _load(self) -> tuple[Journal, int]:
        """The journal, and the length of the log's whole frames (what follows is a torn tail)."""
        try:
            journal = msgspec.msgpack.decode(self.journal_path.read_bytes(), type=Journal)
        except FileNotFoundError:
            raise RunStateError(f"{self.root} is not a miniverl run (no journal); check the run id") from None
        except msgspec.DecodeError:
            raise RunStateError(f"{self.journal_path} is unreadable; the run cannot be resumed") from None
        try:
            updates, whole = _updates(self.log_path.read_bytes())
        except FileNotFoundError:
            updates, whole = [], 0
        for update in updates:
            if update.seq > journal.seq:  # not already in the snapshot (a kill before the log was emptied)
                journal.stages.update(update.stages)
                journal.seq = update.seq
        return journal, whole

    def open_journal(self) -> Journal:
        """The journal for a writer holding the lock: a torn tail left by a killed writer is cut off first."""
        journal, whole = self._load()
        if self.log_path.exists() and self.log_path.stat().st_size != whole:
            truncate_file(self.log_path, whole)
        self._log_bytes, self._snapshot_bytes = whole, self.journal_path.stat().st_size
        return journal

    def write_journal(self, journal: Journal) -> None:
        """The whole journal as a new snapshot, then an empty log (a new run, or compaction)."""
        snapshot = msgspec.msgpack.encode(journal)
        write_bytes_atomic(self.journal_path, snapshot)
        kill_point("journal:snapshot-written")  # the log still holds updates the snapshot has
        if self.log_path.exists():
            truncate_file(self.log_path, 0)
        self._log_bytes, self._snapshot_bytes = 0, len(snapshot)

    def record(self, journal: Journal, *stage_ids: str) -> None:
        """Append these stages' records as they now stand in `journal` (one update, applied whole or not at all)."""
        journal.seq += 1
        frame = _frame(Update(journal.seq, {key: journal.stages[key] for key in stage_ids}))
        try:
            with open(self.log_path, "ab") as handle:
                tear_point("journal.log", handle, frame)
                handle.write(frame)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            journal.seq -= 1
            raise DiskWriteError(exc.errno or 0, f"could not append to {self.log_path}: {exc.strerror or exc}") from exc
        self._log_bytes += len(frame)
        if self._log_bytes >= max(SNAPSHOT_MIN_BYTES, self._snapshot_bytes):
            self.write_journal(journal)

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
    def write_artifact(self, path: str, data: bytes, sha256: str) -> None:
        """Write one output atomically and remember what this process put there (`_unchanged_since_written`)."""
        write_bytes_atomic(self.root / path, data)
        self._written[path] = (_signature(self.root / path), sha256)

    def _unchanged_since_written(self, path: str, sha256: str) -> bool:
        """This process wrote exactly these bytes (`sha256`) to `path` and nothing has touched the file since:
        the same inode, size and modification and change times. Then hashing them again on read checks nothing
        the write did not (they come back from the page cache), and an input read by three stages of a cycle (the
        40 MB adapter of the calc recipe) is hashed once. Another process, or any write or rename since, fails
        the test and the bytes are hashed as always; a resumed run starts with nothing remembered. (A rewrite
        in place of the same length within one tick of the file system's clock would pass; nothing of
        miniverl's writes in place, and the run's lock keeps other runs out.)"""
        known = self._written.get(path)
        if known is None or known[1] != sha256:
            return False
        try:
            return _signature(self.root / path) == known[0]
        except FileNotFoundError:
            return False

    def read_recorded(self, journal: Journal, ref: layout.Ref) -> Any:
        """The artifact `ref` names if its producer is done and recorded it, else None.

        The bytes must hash to what the journal recorded (ArtifactError otherwise), unless this process wrote
        them and the file is unchanged since (`_unchanged_since_written`).
        """
        record = journal.stages.get(ref.producer.id)
        if record is None or record.state != "done" or ref.path not in record.outputs:
            return None
        if journal.is_pruned(ref):
            raise ArtifactPruned(pruned_message(ref.path))
        path, digest = self.root / ref.path, record.outputs[ref.path]
        expected = None if self._unchanged_since_written(ref.path, digest) else digest
        if ref.kind == layout.TENSORS:
            return read_tensors_file(path, expected)
        if ref.kind == layout.JSON:
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                raise ArtifactError(f"{path}: missing") from None
            if expected is not None and sha256_bytes(data) != expected:
                raise ArtifactError(f"{path}: does not match the hash the journal recorded (corrupt or replaced)")
            return json.loads(data)
        return read_artifact(path, ref.kind, expected)

    # ------------------------------------------------------------- manifest
    def read_manifest(self) -> Manifest | None:
        """The terminal manifest, once the run has one (None before, or if it is unreadable)."""
        try:
            return decode_manifest((self.root / layout.MANIFEST_FILE).read_bytes())
        except (OSError, msgspec.DecodeError):
            return None
