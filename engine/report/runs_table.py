"""`miniverl runs`: one row per run directory, read from its journal, lock, events and manifest.

A journal can say a stage is `running` long after its process was killed, so
`running` is claimed only while the run's OS lock is actually held: the lock
is tried without waiting and released at once.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import filelock

from miniverl.engine.core import layout
from miniverl.engine.core.errors import MiniverlError
from miniverl.engine.core.layout import stage_order
from miniverl.engine.core.recipe import parse_recipe
from miniverl.engine.core.rundir import Journal, RunDir

@dataclass(frozen=True)
class RunRow:
    run_id: str
    status: str  # running | failed | done | incomplete | unreadable
    cycles_done: int
    cycles: int | None
    last_stage_done: str | None
    strict_success: str | None  # "baseline -> final" once the manifest exists
    quality_gate: str | None
    started: float | None
    wall_seconds: float | None


def lock_held(run: RunDir) -> bool:
    lock = filelock.FileLock(str(run.root / layout.LOCK_FILE), timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout:
        return True
    except OSError:  # a read-only run directory: nobody can be writing it
        return False
    lock.release()
    return False


def _status(run: RunDir, journal: Journal) -> str:
    if lock_held(run):
        return "running"
    states = {key: record.state for key, record in journal.stages.items()}
    if states.get(layout.StageKey(layout.MANIFEST).id) == "done":
        return "done"
    if "failed" in states.values():
        return "failed"
    return "incomplete"


def _cycles(run: RunDir) -> int | None:
    try:
        return parse_recipe((run.root / layout.RECIPE_FILE).read_text(encoding="utf-8")).train.cycles
    except (OSError, MiniverlError):
        return None


def _manifest_figures(run: RunDir) -> tuple[str | None, str | None]:
    manifest = run.read_manifest()
    if manifest is None:
        return None, None
    gate = "passed" if manifest.quality_gate.passed else "FAILED"
    return f"{manifest.verify_baseline.strict_success:.1%} -> {manifest.verify.strict_success:.1%}", gate


def run_row(run: RunDir) -> RunRow:
    events = run.read_events()
    times = [e["time"] for e in events if isinstance(e.get("time"), (int, float))]
    started, wall = (times[0], times[-1] - times[0]) if times else (None, None)
    try:
        journal = run.read_journal()
    except MiniverlError:
        return RunRow(run.root.name, "unreadable", 0, _cycles(run), None, None, None, started, wall)
    done = sorted((key for key, record in journal.stages.items() if record.state == "done"), key=stage_order)
    success, gate = _manifest_figures(run)
    return RunRow(
        run_id=run.root.name,
        status=_status(run, journal),
        cycles_done=sum(1 for key in done if layout.StageKey.parse(key).name == layout.OPTIMIZER_STEP),
        cycles=_cycles(run),
        last_stage_done=done[-1] if done else None,
        strict_success=success,
        quality_gate=gate,
        started=started,
        wall_seconds=wall,
    )


def list_runs(runs_dir: Path) -> list[RunRow]:
    if not runs_dir.is_dir():
        return []
    runs = [RunDir(path) for path in sorted(runs_dir.iterdir()) if (path / layout.JOURNAL_FILE).is_file()]
    return sorted((run_row(run) for run in runs), key=lambda row: (row.started or 0.0, row.run_id))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


STATUS_STYLE = {"running": "bold cyan", "done": "green", "failed": "bold red", "incomplete": "yellow"}


def table(rows: list[RunRow], runs_dir: Path):
    from rich.table import Table
    from rich.text import Text

    out = Table(title=f"runs in {runs_dir}")
    for column in ("run", "status", "cycle", "last done", "strict success", "gate", "started", "wall"):
        out.add_column(column, no_wrap=True)
    for row in rows:
        started = time.strftime("%m-%d %H:%M", time.localtime(row.started)) if row.started else "-"
        out.add_row(
            row.run_id, Text(row.status, style=STATUS_STYLE.get(row.status, "")),
            f"{row.cycles_done}/{row.cycles if row.cycles is not None else '?'}", row.last_stage_done or "-",
            row.strict_success or "-", row.quality_gate or "-", started, _duration(row.wall_seconds),
        )
    return out


def as_json(rows: list[RunRow]) -> list[dict]:
    return [asdict(row) for row in rows]
