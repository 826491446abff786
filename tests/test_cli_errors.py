"""User errors: exit 2, one line naming the problem, no traceback, no run directory left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import SMALL, miniverl, recipe_dict, write_recipe
from miniverl.engine.models import ASSETS_DIR


def _assert_user_error(result, needle: str, runs: Path | None = None) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    if runs is not None:
        assert not runs.exists() or not any(runs.iterdir())


@pytest.mark.parametrize("override,needle", [
    ({"train.cyclez": 2}, "train.cyclez: unknown key"),
    ({"train.cycles": "two"}, "train.cycles"),
    ({"loss.chunk_size": 0}, "loss.chunk_size"),
    ({"memory.min_chunk_size": 512}, "memory.min_chunk_size"),
    ({"models.student.quantization": "nf4"}, "models.student.quantization"),
    ({"models.student.path": "/nonexistent/model"}, "models.student.path"),
    ({"models.teacher.id": "miniverl-builtin/nope"}, "models.teacher.id"),
    ({"optimizer.name": "paged_adamw_8bit"}, "optimizer.name"),
])
def test_bad_recipes_exit_2_with_one_line(tmp_path, override, needle):
    recipe = write_recipe(tmp_path, recipe_dict(**{**SMALL, **override}))
    runs = tmp_path / "runs"
    _assert_user_error(miniverl("run", str(recipe), "--runs-dir", str(runs)), needle, runs)


def test_missing_recipe_file(tmp_path):
    _assert_user_error(miniverl("run", str(tmp_path / "absent.yaml"), "--runs-dir", str(tmp_path / "runs")),
                       "does not exist", tmp_path / "runs")


def test_incompatible_tokenizer_is_refused_in_preflight(tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(ASSETS_DIR / "protocol_teacher", teacher)
    spec = json.loads((teacher / "tokenizer.json").read_text())
    spec["added_tokens"].append({**spec["added_tokens"][-1], "id": 397, "content": "<extra>"})
    (teacher / "tokenizer.json").write_text(json.dumps(spec))
    recipe = write_recipe(tmp_path, recipe_dict(**{**SMALL, "models.teacher.path": str(teacher)}))
    result = miniverl("run", str(recipe), "--runs-dir", str(tmp_path / "runs"))
    _assert_user_error(result, "tokenizer files differ", tmp_path / "runs")


def test_unknown_run_and_bad_run_id(tmp_path):
    _assert_user_error(miniverl("resume", "nope", "--runs-dir", str(tmp_path)), "no run nope")
    _assert_user_error(miniverl("resume", "../etc", "--runs-dir", str(tmp_path)), "not allowed")
    _assert_user_error(miniverl("stage", "nope", "rollout", "--runs-dir", str(tmp_path)), "no run nope")
