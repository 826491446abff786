"""The `miniverl` command: the typer app, its commands, and the exit codes.

Each command lives in its own small module of this package and only parses
arguments, calls one engine function and prints; the engine is imported inside
the command, so `miniverl --help` starts without loading torch.

Exit codes: 0 the run completed (even if its quality gate failed: the gate is
reported, not hidden), 1 the run failed, 2 a user error (bad recipe, missing
file, incompatible models, run in use), 130 interrupted. User errors print one line.
"""

from __future__ import annotations

import sys

import typer

from miniverl.engine.cli import benchmark, doctor, export, inspection, report, run, runs, validate
from miniverl.engine.cli.common import err
from miniverl.engine.core.errors import MiniverlError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Single-GPU on-policy distillation as resumable stages.")

# Registration order is the order `miniverl --help` lists the commands in.
app.command("run")(run.run_cmd)
app.command("train", help="Alias of `run`.")(run.run_cmd)
app.command("resume")(run.resume_cmd)
app.command("stage")(run.stage_cmd)
app.command("inspect")(inspection.inspect_cmd)
app.command("doctor")(doctor.doctor_cmd)
app.command("validate")(validate.validate_cmd)
app.command("runs")(runs.runs_cmd)
app.command("export-adapter")(export.export_adapter_cmd)
app.command("eval")(export.eval_cmd)
app.command("report")(report.report_cmd)
app.command("export-benchmark")(benchmark.export_benchmark_cmd)
app.command("validate-benchmark")(benchmark.validate_benchmark_cmd)


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
