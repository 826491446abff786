"""`report`: one run as a self-contained HTML page."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from miniverl.engine.cli.common import RUNS_DIR_HELP, out, runs_dir_or_default


def report_cmd(
    run_id: str = typer.Argument(..., help="Run to report on."),
    output: Optional[Path] = typer.Option(None, "--out", help="HTML file to write (default: runs/<id>/report.html)."),
    trajectories: int = typer.Option(2, "--trajectories", min=0, help="Trajectories shown from the first and last cycle."),
    runs_dir: Optional[Path] = typer.Option(None, "--runs-dir", help=RUNS_DIR_HELP),
) -> None:
    """Write a self-contained HTML page with the run's charts, stage table and coloured trajectories."""
    from miniverl.engine.report.html import write_report

    path, notes = write_report(run_id, runs_dir_or_default(runs_dir), output, trajectories)
    for note in notes:
        out.print(note, highlight=False)
    out.print(f"report: {path}", highlight=False)
