"""The run directory: journal round trip, a torn events line, the lock, journal-vouched reads, the append-only journal."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest

from miniverl.engine.core import layout
from miniverl.engine.core.errors import ArtifactError, RunStateError
from miniverl.engine.core import rundir
from miniverl.engine.core.rundir import Journal, RunDir, StageRecord, check_run_id


def test_journal_round_trips_and_an_unreadable_one_is_refused(tmp_path) -> None:
    run = RunDir(tmp_path)
    journal = Journal(run_id="r", stages={"preflight": StageRecord(state="done", outputs={"a": "1"}, inputs={"b": "2"})})
    run.write_journal(journal)
    assert run.read_journal() == journal
    (tmp_path / layout.JOURNAL_FILE).write_bytes(b"\xc1garbage")
    with pytest.raises(RunStateError, match="unreadable"):
        run.read_journal()


def test_events_tolerate_a_torn_last_line(tmp_path) -> None:
    run = RunDir(tmp_path)
    run.event("one", n=1)
    with open(tmp_path / layout.EVENTS_FILE, "a") as handle:
        handle.write('{"event": "tw')  # a process killed mid-line
    assert [e["event"] for e in run.read_events()] == ["one"]


def test_a_second_process_cannot_take_the_lock(tmp_path) -> None:
    run = RunDir(tmp_path / "r")
    code = ("import sys; from pathlib import Path; from miniverl.engine.core.rundir import RunDir\n"
            f"run = RunDir(Path({str(run.root)!r}))\n"
            "try:\n    run.locked().__enter__()\nexcept Exception as exc:\n    print(exc); sys.exit(3)\n")
    with run.locked():
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert other.returncode == 3 and "in use by another miniverl process" in other.stdout
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert again.returncode == 0  # released when the holder let go


def test_read_recorded_trusts_only_journaled_bytes(tmp_path) -> None:
    run = RunDir(tmp_path)
    ref = layout.resolved_ref()
    (tmp_path / ref.path).write_text('{"resolved": {}}')
    from miniverl.engine.core.atomic_io import sha256_file

    done = StageRecord(state="done", outputs={ref.path: sha256_file(tmp_path / ref.path)})
    assert run.read_recorded(Journal("r", {"preflight": done}), ref) == {"resolved": {}}
    assert run.read_recorded(Journal("r", {"preflight": StageRecord(state="running")}), ref) is None
    (tmp_path / ref.path).write_text('{"resolved": {"x": 1}}')
    with pytest.raises(ArtifactError, match="does not match the hash"):
        run.read_recorded(Journal("r", {"preflight": done}), ref)


def test_bytes_this_process_wrote_are_not_hashed_again_until_the_file_changes(tmp_path, monkeypatch) -> None:
    import hashlib

    from miniverl.engine.core.atomic_io import sha256_bytes

    run = RunDir(tmp_path)
    ref = layout.resolved_ref()
    data = b'{"resolved": {"a": 1}}'
    run.write_artifact(ref.path, data, sha256_bytes(data))
    journal = Journal("r", {"preflight": StageRecord(state="done", outputs={ref.path: sha256_bytes(data)})})
    hashed: list[int] = []
    real = hashlib.sha256
    monkeypatch.setattr(hashlib, "sha256", lambda b=b"": hashed.append(len(b)) or real(b))
    assert run.read_recorded(journal, ref) == {"resolved": {"a": 1}} and hashed == []
    # The same length rewritten in place (its times set apart, as a clock finer than the writes would):
    # the bytes are hashed and refused.
    with open(tmp_path / ref.path, "r+b") as handle:
        handle.write(b'{"resolved": {"a": 2}}')
    os.utime(tmp_path / ref.path, ns=(1, 1))
    with pytest.raises(ArtifactError, match="does not match the hash"):
        run.read_recorded(journal, ref)
    assert hashed
    # Another RunDir of the same directory (another process, a resume) remembers nothing: it hashes.
    run.write_artifact(ref.path, data, sha256_bytes(data))
    hashed.clear()
    assert RunDir(tmp_path).read_recorded(journal, ref) == {"resolved": {"a": 1}} and hashed == [len(data)]


@pytest.mark.parametrize("bad", ["../up", "a/b", "", ".hidden", "x" * 101])
def test_run_ids_cannot_escape_the_runs_directory(bad) -> None:
    with pytest.raises(RunStateError, match="is not allowed"):
        check_run_id(bad)


# ---------------------------------------------------------------- the append-only journal
def _journal_with(run: RunDir, n: int) -> Journal:
    journal = Journal(run_id="r")
    run.write_journal(journal)
    for i in range(n):
        journal.stages[f"c{i:06d}/rollout"] = StageRecord(state="done", outputs={f"cycles/{i:06d}/rollout.msgpack": "a" * 64})
        run.record(journal, f"c{i:06d}/rollout")
    return journal


def test_recording_appends_one_record_of_a_size_that_does_not_grow_with_the_run(tmp_path, monkeypatch) -> None:
    from miniverl.engine.core import rundir

    monkeypatch.setattr(rundir, "SNAPSHOT_MIN_BYTES", 10**9)  # no snapshot: watch the log alone
    run = RunDir(tmp_path)
    journal = _journal_with(run, 3)
    sizes = []
    for i in range(3, 400):
        journal.stages[f"c{i:06d}/rollout"] = StageRecord(state="running", pid=1)
        before = run.log_path.stat().st_size
        run.record(journal, f"c{i:06d}/rollout")
        sizes.append(run.log_path.stat().st_size - before)
    assert max(sizes) - min(sizes) <= 4  # the same bytes at record 4 and at record 400 (but the seq's varint)
    assert run.read_journal() == journal
    assert run.journal_path.stat().st_size < 200  # the snapshot was never rewritten


def test_a_snapshot_now_and_then_empties_the_log_and_keeps_every_record(tmp_path) -> None:
    run = RunDir(tmp_path)
    journal = _journal_with(run, 100)
    assert run.read_journal() == journal
    assert run.log_path.stat().st_size < run.journal_path.stat().st_size  # compacted at least once
    assert msgspec.msgpack.decode(run.journal_path.read_bytes(), type=Journal).seq > 0


def test_a_torn_tail_is_ignored_by_readers_and_cut_off_by_the_next_writer(tmp_path) -> None:
    run = RunDir(tmp_path)
    journal = _journal_with(run, 5)
    whole = run.log_path.read_bytes()
    journal.stages["manifest"] = StageRecord(state="done")
    journal.seq += 1
    torn = rundir._frame(rundir.Update(journal.seq, {"manifest": journal.stages["manifest"]}))
    for cut in (1, 7, len(torn) - 1):  # inside the header, inside the payload, one byte short
        run.log_path.write_bytes(whole + torn[:cut])
        assert "manifest" not in run.read_journal().stages
    flipped = bytearray(torn)
    flipped[-1] ^= 0xFF  # whole length, wrong checksum
    run.log_path.write_bytes(whole + bytes(flipped))
    assert "manifest" not in run.read_journal().stages
    writer = RunDir(tmp_path)
    reopened = writer.open_journal()
    assert run.log_path.read_bytes() == whole and "manifest" not in reopened.stages
    reopened.stages["manifest"] = StageRecord(state="done")
    writer.record(reopened, "manifest")  # appended after the cut, so it is read back
    assert RunDir(tmp_path).read_journal().stages["manifest"].state == "done"


def test_a_kill_between_a_snapshot_and_emptying_the_log_replays_nothing_twice(tmp_path) -> None:
    run = RunDir(tmp_path)
    journal = _journal_with(run, 5)
    log = run.log_path.read_bytes()
    journal.stages["c000000/rollout"] = StageRecord(state="pending")
    run.record(journal, "c000000/rollout")
    log = run.log_path.read_bytes()
    run.journal_path.write_bytes(msgspec.msgpack.encode(journal))  # the snapshot landed ...
    assert run.log_path.read_bytes() == log  # ... and the log still holds what it already has
    journal.stages["c000000/rollout"] = StageRecord(state="done")
    writer = RunDir(tmp_path)
    reopened = writer.open_journal()
    assert reopened == run.read_journal() and reopened.stages["c000000/rollout"].state == "pending"
    reopened.stages["c000000/rollout"] = StageRecord(state="done")
    writer.record(reopened, "c000000/rollout")
    assert RunDir(tmp_path).read_journal() == reopened


def test_a_writer_killed_mid_append_leaves_a_journal_that_reads_and_resumes(tmp_path) -> None:
    """A real SIGKILL after half a record reached the disk (the `tear:journal.log` kill point)."""
    run = RunDir(tmp_path)
    _journal_with(run, 3)
    code = ("from pathlib import Path\nfrom miniverl.engine.core.rundir import RunDir, StageRecord\n"
            f"run = RunDir(Path({str(tmp_path)!r}))\njournal = run.open_journal()\n"
            "journal.stages['manifest'] = StageRecord(state='done')\nrun.record(journal, 'manifest')\n")
    killed = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MINIVERL_FAULT_KILL_AT": "tear:journal.log"})
    assert killed.returncode == -9
    journal = RunDir(tmp_path).open_journal()
    assert sorted(journal.stages) == ["c000000/rollout", "c000001/rollout", "c000002/rollout"]
