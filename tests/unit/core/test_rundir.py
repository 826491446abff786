"""The run directory: journal round trip, a torn events line, the lock, journal-vouched reads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from miniverl.engine.core import layout
from miniverl.engine.core.errors import ArtifactError, RunStateError
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


@pytest.mark.parametrize("bad", ["../up", "a/b", "", ".hidden", "x" * 101])
def test_run_ids_cannot_escape_the_runs_directory(bad) -> None:
    with pytest.raises(RunStateError, match="is not allowed"):
        check_run_id(bad)
