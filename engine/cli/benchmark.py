"""`export-benchmark` and `validate-benchmark`: a finished run as a hardware result, and its check."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from miniverl.engine.cli.common import RUNS_DIR_HELP, exit_with_problems, out, runs_dir_or_default


def export_benchmark_cmd(
    run_id: str = typer.Argument(..., help="A finished run."),
    notes: str = typer.Option(..., "--notes", help="Free text: the machine, anything unusual about the run."),
    output: Optional[Path] = typer.Option(None, "--out", help="JSON file to write (default: runs/<id>/hardware_result.json)."),
    runs_dir: Optional[Path] = typer.Option(None, "--runs-dir", help=RUNS_DIR_HELP),
) -> None:
    """Export a finished run as a hardware result: configuration, provenance, measurements, notes."""
    from miniverl.engine.report.benchmark import export

    path = export(run_id, runs_dir_or_default(runs_dir), notes, output)
    out.print(f"hardware result: {path}; check it with `miniverl validate-benchmark {path}`", highlight=False)


def validate_benchmark_cmd(
    document: Path = typer.Argument(..., help="A hardware-result JSON file."),
    schema: Optional[Path] = typer.Option(None, "--schema", help="Schema file (default: the built-in one, "
                                          "benchmarks/hardware_result.schema.json)."),
) -> None:
    """Check a hardware result against its schema; every problem is named by its JSON path."""
    from miniverl.engine.report.benchmark import check_file

    problems = check_file(document, schema)
    exit_with_problems(problems)
    out.print(f"{document}: a valid hardware result", highlight=False)
