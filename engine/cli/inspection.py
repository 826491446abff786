"""`inspect`: what a run, or one artifact file, holds.

(Named inspection.py, not inspect.py, so that it can never shadow the standard
library's `inspect` module.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from miniverl.engine.cli.common import RUNS_DIR_HELP, out, runs_dir_or_default


def inspect_cmd(
    target: str = typer.Argument(..., help="A run id, or the path of an artifact file."),
    stage: Optional[str] = typer.Argument(None, help="Stage whose artifact to show (default: the stage table)."),
    cycle: Optional[int] = typer.Option(None, "--cycle", help="Cycle of a per-cycle stage."),
    limit: int = typer.Option(3, "--limit", help="How many trajectories or items to print."),
    runs_dir: Optional[Path] = typer.Option(None, "--runs-dir", help=RUNS_DIR_HELP),
) -> None:
    """Show what a run or one of its artifacts holds: decoded spans, losses, timings."""
    from miniverl.engine.report import inspect as inspect_run
    from miniverl.engine.run.commands import open_run, quiet_libraries

    quiet_libraries()
    if Path(target).is_file():
        inspect_run.show_file(out, Path(target), limit)
        return
    run, recipe = open_run(target, runs_dir_or_default(runs_dir))
    if stage is None:
        out.print(inspect_run.journal_table(run))
        return
    artifact = inspect_run.load_any(inspect_run.artifact_path(run, stage, cycle))
    inspect_run.show(out, artifact, run.root, inspect_run.student_tokenizer(recipe), limit)
