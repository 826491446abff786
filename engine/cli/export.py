"""`export-adapter` and `eval`: the trained student outside the tool, and the verifier for any adapter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import msgspec
import typer
from rich.markup import escape

from miniverl.engine.cli.common import RUNS_DIR_HELP, out, runs_dir_or_default

FAILURES_SHOWN = 5


def export_adapter_cmd(
    run_id: str = typer.Argument(..., help="Run whose adapter to export."),
    dest: Path = typer.Option(..., "--out", help="Directory to write (it appears whole or not at all)."),
    runs_dir: Optional[Path] = typer.Option(None, "--runs-dir", help=RUNS_DIR_HELP),
    step: Optional[int] = typer.Option(None, "--step", help="Checkpoint to export (default: the final one; "
                                       "an unfinished run needs it)."),
    merge: bool = typer.Option(False, "--merge", help="Also write DIR/merged: the base with the adapter merged in."),
    force: bool = typer.Option(False, "--force", help="Replace DIR if it exists."),
) -> None:
    """Write RUN_ID's trained adapter as a standard PEFT directory (adapter, tokenizer, model card)."""
    from miniverl.engine.export.adapter_export import export_adapter

    done = export_adapter(run_id, runs_dir_or_default(runs_dir), dest, step, merge, force)
    which = "final" if done.finished and step is None else f"step {done.step}"
    out.print(f"exported the {which} adapter of run {escape(run_id)} to {escape(str(done.directory))} "
              f"(adapter_model.safetensors sha256 {done.adapter_sha256[:12]})", highlight=False)
    if done.merged is not None:
        out.print(f"merged model in {escape(str(done.merged))}", highlight=False)


def eval_cmd(
    target: str = typer.Argument(..., metavar="RECIPE|RUN_ID", help="A recipe file, or a run (its recipe and task)."),
    runs_dir: Optional[Path] = typer.Option(None, "--runs-dir", help=RUNS_DIR_HELP),
    adapter: Optional[Path] = typer.Option(None, "--adapter", help="A PEFT LoRA directory for the recipe's student."),
    base: bool = typer.Option(False, "--base", help="Evaluate the bare student base (the baseline)."),
    n: Optional[int] = typer.Option(None, "--n", help="Held-out tasks to evaluate (default task.heldout_size)."),
    step: Optional[int] = typer.Option(None, "--step", help="With a run id: its checkpoint K (default the final)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Run the strict held-out verifier on an adapter, a run's checkpoint, or the base."""
    from miniverl.engine.core.progress import Reporter
    from miniverl.engine.export.evaluate import evaluate_policy

    result = evaluate_policy(target, runs_dir_or_default(runs_dir), adapter, base, n, step, Reporter())
    report = result.report
    failures = [item for item in report.items if not item.strict_success]
    if as_json:
        document = {"target": result.target, "policy": result.policy, "adapter_sha256": report.policy_adapter_sha256,
                    "tasks": report.tasks, "tool_call_rate": report.tool_call_rate,
                    "format_validity": report.format_validity, "strict_success": report.strict_success,
                    "failures": [msgspec.to_builtins(item) for item in failures[:FAILURES_SHOWN]],
                    "items": [msgspec.to_builtins(item) for item in report.items]}
        out.print_json(json.dumps(document))
        return
    out.print(f"{escape(result.policy)} on {report.tasks} held-out tasks of {escape(result.target)}: "
              f"tool-call rate {report.tool_call_rate:.1%}, format validity {report.format_validity:.1%}, "
              f"strict success {report.strict_success:.1%}", highlight=False)
    if failures:
        out.print(f"{len(failures)} failed; the first {min(len(failures), FAILURES_SHOWN)}:", highlight=False)
    for item in failures[:FAILURES_SHOWN]:
        failed = ", ".join(name for name, ok in item.checks.items() if not ok)
        last = " ".join(item.turns[-1].split())[:160] if item.turns else ""
        out.print(f"  {escape(item.task_id)} ({escape(failed)}): {escape(item.question)!s} -> {escape(last)}",
                  highlight=False)
