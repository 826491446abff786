"""`validate`: a recipe's problems, all at once, or its configuration as it resolves here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from miniverl.engine.cli.common import exit_with_problems, out


def validate_cmd(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    overrides: Optional[list[str]] = typer.Argument(
        None, metavar="[KEY=VALUE]...", show_default=False, help="Recipe keys to change first, as `run` takes them."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Check RECIPE (every problem at once) and print its configuration as it resolves here."""
    from miniverl.engine.checks import validate

    result = validate.validate_file(recipe, overrides or ())
    if as_json:
        out.print_json(json.dumps(validate.as_json(result)))
    elif not result.problems:
        validate.render(out, result)
    exit_with_problems(result.problems)
