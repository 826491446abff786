"""`doctor`: what this machine offers a run."""

from __future__ import annotations

import json

import typer

from miniverl.engine.cli.common import out


def doctor_cmd(as_json: bool = typer.Option(False, "--json", help="Print the findings as JSON.")) -> None:
    """Python, torch and CUDA, the device and its memory, bf16 and `dtype: auto`, optional dependencies."""
    from miniverl.engine.checks import doctor

    report = doctor.collect()
    if as_json:
        out.print_json(json.dumps(report))
    else:
        doctor.render(out, report)
