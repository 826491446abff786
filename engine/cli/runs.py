"""`runs`: the table of runs in a runs directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from miniverl.engine.cli.common import RUNS_DIR_HELP, out, runs_dir_or_default


def runs_cmd(
    runs_dir: Optional[Path] = typer.Option(None, "--runs-dir", help=RUNS_DIR_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
) -> None:
    """List the runs: status, cycle reached, last stage done, strict success, wall time."""
    from miniverl.engine.report import runs_table

    directory = runs_dir_or_default(runs_dir)
    rows = runs_table.list_runs(directory)
    if as_json:
        out.print_json(json.dumps(runs_table.as_json(rows)))
    elif not rows:
        out.print(f"no runs in {directory}", highlight=False)
    else:
        out.print(runs_table.table(rows, directory))
