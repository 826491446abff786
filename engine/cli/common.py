"""What every command shares: the two consoles, the runs directory, and how user errors end a command."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

out = Console(soft_wrap=True)
err = Console(stderr=True)

RUNS_DIR_HELP = "Directory holding runs (default: ./runs, or $MINIVERL_RUNS_DIR)."


def runs_dir_or_default(value: Optional[Path]) -> Path:
    return value or Path(os.environ.get("MINIVERL_RUNS_DIR", "runs"))


def exit_with_problems(problems: list[str]) -> None:
    """One stderr line per problem, then exit 2 (a user error)."""
    for problem in problems:
        err.print(f"[bold red]error:[/] {escape(problem)}", highlight=False, soft_wrap=True)
    if problems:
        raise typer.Exit(2)
