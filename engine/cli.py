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

from .errors import MiniverlError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Single-GPU on-policy distillation as resumable stages.")
out = Console(soft_wrap=True)
err = Console(stderr=True)

RUNS_DIR_HELP = "Directory holding runs (default: ./runs, or $MINIVERL_RUNS_DIR)."


def _runs_dir(value: Optional[Path]) -> Path:
    return value or Path(os.environ.get("MINIVERL_RUNS_DIR", "runs"))


def _finish_run(run) -> None:
    from .runner import read_manifest

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
    dry_run: bool = typer.Option(False, "--dry-run", help="Check models, tokenizers and configuration; train nothing."),
) -> None:
    """Start a run from RECIPE and drive it to the end."""
    from .progress import Reporter
    from .runner import dry_run as do_dry_run, start_run

    if dry_run:
        out.print_json(json.dumps(do_dry_run(recipe)))
        return
    _finish_run(start_run(recipe, run_id, _runs_dir(runs_dir), Reporter()))


app.command("train", help="Alias of `run`.")(run_cmd)


@app.command("resume")
def resume_cmd(
    run_id: str = typer.Argument(..., help="Run to continue."),
    runs_dir: Optional[Path] = typer.Option(None, "--runs-dir", help=RUNS_DIR_HELP),
) -> None:
    """Continue RUN_ID at the first stage that is not done (a finished run is left as it is)."""
    from .progress import Reporter
    from .runner import resume_run

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
    from .progress import Reporter
    from .runner import rerun_stage

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
    from . import inspect_run
    from .models import load_tokenizer
    from .rundir import RunDir
    from .runner import open_run, quiet_libraries

    quiet_libraries()
    path = Path(target)
    if path.is_file():
        out_artifact = inspect_run.load_any(path)
        inspect_run.show(out, out_artifact, None, None, limit)
        return
    run, recipe = open_run(target, _runs_dir(runs_dir))
    if stage is None:
        out.print(inspect_run.journal_table(run))
        return
    from .model_host import ModelHost

    artifact = inspect_run.load_any(inspect_run.artifact_path(run, stage, cycle))
    try:
        from .models import locate_model

        s = recipe.models.student
        tokenizer = load_tokenizer(locate_model("student", s.id, s.revision, s.path))
    except MiniverlError:
        tokenizer = None
    inspect_run.show(out, artifact, run.root, tokenizer, limit)


def main() -> None:
    try:
        app(standalone_mode=False)
    except MiniverlError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted; `miniverl resume RUN_ID` continues where the run stopped")
        sys.exit(130)
    except Exception as exc:  # click usage errors and anything unforeseen
        import click

        if isinstance(exc, click.exceptions.Exit):
            sys.exit(exc.exit_code)
        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
