"""`run` (and its alias `train`), `resume` and `stage`: the commands that drive a run's stages."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from miniverl.engine.cli.common import RUNS_DIR_HELP, exit_with_problems, out, runs_dir_or_default


def _finish_run(run) -> None:
    from miniverl.engine.core.layout import MANIFEST_FILE

    manifest = run.read_manifest()
    if manifest is None:
        return
    gate, v, b = manifest.quality_gate, manifest.verify, manifest.verify_baseline
    where = run.root / MANIFEST_FILE
    out.print(f"strict held-out success {b.strict_success:.1%} -> {v.strict_success:.1%}, "
              f"tool-call rate {v.tool_call_rate:.1%}")
    if gate.passed:
        out.print(f"[green]quality gate passed[/]; manifest: {where}")
    else:
        out.print(f"[bold red]quality gate FAILED ({gate.reason})[/]: the run completed but the skill was not learned; "
                  f"manifest: {where}")


def run_cmd(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    overrides: Optional[list[str]] = typer.Argument(
        None, metavar="[KEY=VALUE]...", show_default=False,
        help="Recipe keys to change for this run, dotted and YAML-typed: train.cycles=80 loss.chunk_size=32."),
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
        report = checks.dry_run(recipe, overrides or ())
        if as_json:
            out.print_json(checks.to_json(report))
        else:
            checks.render(out, report)
        exit_with_problems(report.problems)
        return
    from miniverl.engine.core.progress import Reporter
    from miniverl.engine.run.commands import start_run

    _finish_run(start_run(recipe, run_id, runs_dir_or_default(runs_dir), Reporter(), overrides or ()))


def resume_cmd(
    run_id: str = typer.Argument(..., help="Run to continue."),
    runs_dir: Optional[Path] = typer.Option(None, "--runs-dir", help=RUNS_DIR_HELP),
) -> None:
    """Continue RUN_ID at the first stage that is not done (a finished run is left as it is)."""
    from miniverl.engine.core.progress import Reporter
    from miniverl.engine.run.commands import resume_run

    _finish_run(resume_run(run_id, runs_dir_or_default(runs_dir), Reporter()))


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

    rerun_stage(run_id, runs_dir_or_default(runs_dir), stage, cycle, label, Reporter())
    out.print(f"stage {stage} rerun")
