"""The CLI only parses and calls: every registered command is listed, each module stays small, and
importing the app loads no torch (the engine is imported inside the commands)."""

from __future__ import annotations

import subprocess
import sys

from support import ROOT

from typer.testing import CliRunner

from miniverl.engine.cli.app import app

CLI = ROOT / "engine" / "cli"
HEAVY = ("torch", "transformers", "peft", "safetensors", "bitsandbytes")


def test_every_registered_command_is_listed_in_help_with_its_help_text():
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    names = [command.name for command in app.registered_commands]
    assert names == ["run", "train", "resume", "stage", "inspect", "doctor", "validate", "runs", "export-adapter",
                     "eval", "report", "export-benchmark", "validate-benchmark"]
    # The commands panel: one row per command, `│ name   help text   │`.
    panel = result.output.split("Commands")[1]
    rows = dict(line.strip("│ ").split(None, 1) for line in panel.splitlines() if line.startswith("│"))
    assert list(rows) == names, result.output
    for command in app.registered_commands:
        summary = (command.help or command.callback.__doc__).splitlines()[0]
        assert rows[command.name].strip() == summary, (command.name, result.output)


def test_cli_modules_stay_short():
    lengths = {path.name: len(path.read_text().splitlines()) for path in CLI.glob("*.py")}
    assert {"app.py", "common.py"} <= set(lengths)
    assert all(n < 120 for n in lengths.values()), lengths


def test_importing_the_app_loads_no_torch():
    probe = (f"import sys, miniverl.engine.cli.app; "
             f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
