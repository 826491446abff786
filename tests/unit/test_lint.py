"""The lint rules CI holds the tree to (pyproject's [tool.ruff]), run here too so pytest alone enforces them.

No pickle and no torch.load (artifacts are msgpack + safetensors), no eval or exec
(the calculator parses its expressions), no unsafe yaml.load.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT

CONFIG = ROOT / "pyproject.toml"


def ruff(*paths: Path | str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
               "--config", str(CONFIG), *map(str, paths)]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_the_tree_passes_the_lint_rules():
    result = ruff(".")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("source,code", [
    ("import pickle\n", "TID251"),
    ("from pickle import loads\n", "TID251"),
    ("import torch\n\ntorch.load('adapter.pt')\n", "TID251"),
    ("from torch import load\n", "TID251"),
    ("def f(x):\n    return eval(x)\n", "S307"),
    ("def f(x):\n    exec(x)\n", "S102"),
    ("import yaml\n\nyaml.load(open('r.yaml'))\n", "S506"),
])
def test_a_violation_is_caught(tmp_path, source, code):
    bad = tmp_path / "bad.py"
    bad.write_text(source)
    result = ruff(bad)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "bad.py:" in result.stdout and f" {code} " in result.stdout, result.stdout
