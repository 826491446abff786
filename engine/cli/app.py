"""The `miniverl` command. It parses arguments and calls engine functions.

Exit codes: 0 the run completed (even if its quality gate failed: the gate is
reported, not hidden), 1 the run failed, 2 a user error (bad recipe, missing
file, incompatible models, run in use). User errors print one line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from miniverl.engine.core.errors import MiniverlError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Single-GPU on-policy distillation as resumable stages.")
out = Console(soft_wrap=True)
err = Console(stderr=True)

RUNS_DIR_HELP = "Directory holding runs (default: ./runs, or $MINIVERL_RUNS_DIR)."


def _runs_dir(value: Optional[Path]) -> Path:
    return value or Path(os.environ.get("MINIVERL_RUNS_DIR", "runs"))


def _exit_with_problems(problems: list[str]) -> None:
    """One stderr line per problem, then exit 2 (a user error)."""
    for problem in problems:
        err.print(f"[bold red]error:[/] {escape(problem)}", highlight=False, soft_wrap=True)
    if problems:
        raise typer.Exit(2)


def _finish_run(run) -> None:
    from miniverl.engine.run.commands import read_manifest

    manifest = read_manifest(run)
    if manifest is None:
        return
    gate = manifest["quality_gate"]
    v, b = manifest["verify"], manifest["verify_baseline"]
    out.print(f"strict held-out success {b['strict_success']:.1%} -> {v['strict_success']:.1%}, "
              f"tool-call rate {v['tool_call_rate']:.1%}")
    if gate["passed"]:
        out.print(f"[green]quality gate passed[/]; manifest: {run.root / 'manifest.json'}")
    else:
        out.print(f"[bold red]quality gate FAILED ({gate['reason']})[/]: the run completed but the skill was not learned; "
                  f"manifest: {run.root / 'manifest.json'}")


@app.command("run")
def run_cmd(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="Name of the run (default: recipe name + time)."),
    runs_dir: Optional[Path] = typer.Option(None, "--runs-dir", help=RUNS_DIR_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check models, tokenizers, adapters and memory; train nothing."),
    as_json: bool = typer.Option(False, "--json", help="With --dry-run: print the report as JSON."),
) -> None:
    """Start a run from RECIPE and drive it to the end."""
    if dry_run:
        from miniverl.engine.checks import dry_run as checks
        from miniverl.engine.run.commands import quiet_libraries

        quiet_libraries()
        report = checks.dry_run(recipe)
        if as_json:
            out.print_json(json.dumps(report))
        else:
            checks.render(out, report)
        _exit_with_problems(report["problems"])
        return
    from miniverl.engine.core.progress import Reporter
    from miniverl.engine.run.commands import start_run

    _finish_run(start_run(recipe, run_id, _runs_dir(runs_dir), Reporter()))


app.command("train", help="Alias of `run`.")(run_cmd)


@app.command("resume")
def resume_cmd(
    run_id: str = typer.Argument(..., help="Run to continue."),
    runs_dir: Optional[Path] = typer.Option(None, "--runs-dir", help=RUNS_DIR_HELP),
) -> None:
    """Continue RUN_ID at the first stage that is not done (a finished run is left as it is)."""
    from miniverl.engine.core.progress import Reporter
    from miniverl.engine.run.commands import resume_run

    _finish_run(resume_run(run_id, _runs_dir(runs_dir), Reporter()))


@app.command("stage")
def stage_cmd(
    run_id: str = typer.Argument(..., help="Run holding the stage."),
    stage: str = typer.Argument(..., help="preflight | rollout | teacher_score | gradient | optimizer_step | verify | manifest"),
    cycle: Optional[int] = typer.Option(None, "--cycle", help="Cycle of a per-cycle stage."),
    label: Optional[str] = typer.Option(None, "--label", help="verify only: baseline or final (default final)."),
    runs_dir: Optional[Path] = typer.Option(None, "--runs-dir", help=RUNS_DIR_HELP),
) -> None:
    """Rerun one stage from its inputs on disk (for debugging)."""
    from miniverl.engine.core.progress import Reporter
    from miniverl.engine.run.commands import rerun_stage

    rerun_stage(run_id, _runs_dir(runs_dir), stage, cycle, label, Reporter())
    out.print(f"stage {stage} rerun")


@app.command("inspect")
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
    run, recipe = open_run(target, _runs_dir(runs_dir))
    if stage is None:
        out.print(inspect_run.journal_table(run))
        return
    artifact = inspect_run.load_any(inspect_run.artifact_path(run, stage, cycle))
    inspect_run.show(out, artifact, run.root, inspect_run.student_tokenizer(recipe), limit)


@app.command("doctor")
def doctor_cmd(as_json: bool = typer.Option(False, "--json", help="Print the findings as JSON.")) -> None:
    """Python, torch and CUDA, the device and its memory, bf16 and `dtype: auto`, optional dependencies."""
    from miniverl.engine.checks import doctor

    report = doctor.collect()
    if as_json:
        out.print_json(json.dumps(report))
    else:
        doctor.render(out, report)


@app.command("validate")
def validate_cmd(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Check RECIPE (every problem at once) and print its configuration as it resolves here."""
    from miniverl.engine.checks import validate

    result = validate.validate_file(recipe)
    if as_json:
        out.print_json(json.dumps(validate.as_json(result)))
    elif not result.problems:
        validate.render(out, result)
    _exit_with_problems(result.problems)


@app.command("runs")
def runs_cmd(
    runs_dir: Optional[Path] = typer.Option(None, "--runs-dir", help=RUNS_DIR_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
) -> None:
    """List the runs: status, cycle reached, last stage done, strict success, wall time."""
    from miniverl.engine.report import runs_table

    directory = _runs_dir(runs_dir)
    rows = runs_table.list_runs(directory)
    if as_json:
        out.print_json(json.dumps(runs_table.as_json(rows)))
    elif not rows:
        out.print(f"no runs in {directory}", highlight=False)
    else:
        out.print(runs_table.table(rows, directory))


@app.command("report")
def report_cmd(
    run_id: str = typer.Argument(..., help="Run to report on."),
    output: Optional[Path] = typer.Option(None, "--out", help="HTML file to write (default: runs/<id>/report.html)."),
    trajectories: int = typer.Option(2, "--trajectories", min=0, help="Trajectories shown from the first and last cycle."),
    runs_dir: Optional[Path] = typer.Option(None, "--runs-dir", help=RUNS_DIR_HELP),
) -> None:
    """Write a self-contained HTML page with the run's charts, stage table and coloured trajectories."""
    from miniverl.engine.report.html import write_report

    path, notes = write_report(run_id, _runs_dir(runs_dir), output, trajectories)
    for note in notes:
        out.print(note, highlight=False)
    out.print(f"report: {path}", highlight=False)


@app.command("export-benchmark")
def export_benchmark_cmd(
    run_id: str = typer.Argument(..., help="A finished run."),
    notes: str = typer.Option(..., "--notes", help="Free text: the machine, anything unusual about the run."),
    output: Optional[Path] = typer.Option(None, "--out", help="JSON file to write (default: runs/<id>/hardware_result.json)."),
    runs_dir: Optional[Path] = typer.Option(None, "--runs-dir", help=RUNS_DIR_HELP),
) -> None:
    """Export a finished run as a hardware result: configuration, provenance, measurements, notes."""
    from miniverl.engine.report.benchmark import export

    path = export(run_id, _runs_dir(runs_dir), notes, output)
    out.print(f"hardware result: {path}; check it with `miniverl validate-benchmark {path}`", highlight=False)


@app.command("validate-benchmark")
def validate_benchmark_cmd(
    document: Path = typer.Argument(..., help="A hardware-result JSON file."),
    schema: Optional[Path] = typer.Option(None, "--schema", help="Schema file (default: the built-in one, "
                                          "benchmarks/hardware_result.schema.json)."),
) -> None:
    """Check a hardware result against its schema; every problem is named by its JSON path."""
    from miniverl.engine.report.benchmark import check_file

    problems = check_file(document, schema)
    _exit_with_problems(problems)
    out.print(f"{document}: a valid hardware result", highlight=False)


def main() -> None:
    try:
        code = app(standalone_mode=False)  # without standalone mode, click returns typer.Exit's code
        if isinstance(code, int) and code != 0:
            sys.exit(code)
    except MiniverlError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted; `miniverl resume RUN_ID` continues where the run stopped")
        sys.exit(130)
    except Exception as exc:  # usage errors, and anything unforeseen
        # typer vendors its own click (typer._click), so its usage errors are not click's
        # classes: recognise them by the ClickException interface instead.
        show, code = getattr(exc, "show", None), getattr(exc, "exit_code", None)
        if callable(show) and isinstance(code, int):
            show()
            sys.exit(code)
        raise


if __name__ == "__main__":
    main()
