"""User errors: exit 2, one line naming the problem, no traceback, no run directory left behind."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import SMALL, miniverl, recipe_dict, write_recipe
from miniverl.engine.models.loading import ASSETS_DIR


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
    ({"optimizer.lr": -0.1}, "optimizer.lr"),
    ({"optimizer.beta1": 1.0}, "optimizer.beta1"),
    ({"train.trajectory_batch_size": 0}, "train.trajectory_batch_size"),
    ({"train.rollouts_per_cycle": -3}, "train.rollouts_per_cycle"),
    ({"rollout.temperature": 0}, "rollout.temperature"),
    ({"rollout.max_turns": 0}, "rollout.max_turns"),
    ({"rollout.max_new_tokens_per_turn": 4096}, "rollout.max_new_tokens_per_turn"),
    ({"loss.divergence": "kl"}, "loss.divergence"),
    ({"loss.jsd_beta": 1.5}, "loss.jsd_beta"),
    ({"loss.topk": 0}, "loss.topk"),
    ({"memory.strategy": "offload"}, "memory.strategy"),
    ({"memory.budget": 0.5}, "at 8 and memory.budget is 0.50 GiB; lower rollout.generation_batch_size or set it to auto"),
    ({"memory.budget": "lots"}, "recipe key memory.budget"),
    ({"train.trajectory_batch_size": "most"}, "recipe key train.trajectory_batch_size"),
    ({"memory.strategy": "swap", "models.student.quantization": "nf4"}, "models.student.quantization"),
    ({"models.runtime": "shared_backbone"}, "models.runtime"),
    ({"models.student.lora.r": 0}, "models.student.lora.r"),
    ({"models.student.lora.dropout": 1.0}, "models.student.lora.dropout"),
    ({"dtype": "float8"}, "dtype"),
    ({"dtype": "bfloat16", "models.device": "cpu"}, "dtype"),
    ({"models.device": "cuda"}, "models.device"),
    ({"task.operand_max": 5}, "task.operand_max"),
    ({"task.name": "chess"}, "task.name"),
    ({"seed": -1}, "seed"),
    ({"name": 7}, "name"),
    ({"verify.min_tool_call_rate": 2}, "verify.min_tool_call_rate"),
])
def test_bad_recipes_exit_2_with_one_line(tmp_path, override, needle):
    recipe = write_recipe(tmp_path, recipe_dict(**{**SMALL, **override}))
    runs = tmp_path / "runs"
    _assert_user_error(miniverl("run", str(recipe), "--runs-dir", str(runs)), needle, runs)


@pytest.mark.parametrize("override,needle", [
    ({"train.cycles": 10**9}, "recipe key train.cycles: expected integer >= 1 and <= 100000; got integer 1000000000; "
                              "100,000 optimizer steps is far beyond any OPD run"),
    ({"rollout.max_total_tokens": 10**9}, "recipe key rollout.max_total_tokens: expected integer >= 1 and <= 1048576"),
    ({"rollout.max_total_tokens": 100_000}, "recipe key rollout.max_total_tokens: 100,000 is beyond the student's "
                                            "context (max_position_embeddings 512)"),
    ({"task.heldout_size": 10**9}, "recipe key task.heldout_size: expected integer >= 1 and <= 100000"),
    ({"task.operand_max": 10}, "recipe key train.rollouts_per_cycle: 8 asks for more distinct train items"),
    ({"train.rollouts_per_cycle": 10**6}, "recipe key train.rollouts_per_cycle: expected integer >= 1 and <= 4096"),
    ({"models.student.lora.r": 10**6}, "recipe key models.student.lora.r: expected integer >= 1 and <= 1024"),
])
def test_values_that_would_hang_or_exhaust_the_machine_are_refused_at_once(tmp_path, override, needle):
    """Issue 13: each of these once hung silently or grew without bound; now one line, within seconds."""
    recipe = write_recipe(tmp_path, recipe_dict(**{**SMALL, **override}))
    runs = tmp_path / "runs"
    started = time.monotonic()
    result = miniverl("run", str(recipe), "--runs-dir", str(runs))
    assert time.monotonic() - started < 30  # a Python start and the checks; the hang it replaces never ended
    _assert_user_error(result, needle, runs)


@pytest.mark.parametrize("item,needle", [
    ("train.cyclez=3", "recipe key train.cyclez: unknown key"),
    ("loss.chunk_size=big", "recipe key loss.chunk_size: expected integer"),
    ("train.cycles=1000000000", "recipe key train.cycles: expected integer >= 1 and <= 100000"),
    ("train.cycles", "override 'train.cycles': expected KEY=VALUE"),
])
def test_a_bad_command_line_override_exits_2_naming_the_key(tmp_path, item, needle):
    recipe = write_recipe(tmp_path, recipe_dict(**SMALL))
    runs = tmp_path / "runs"
    _assert_user_error(miniverl("run", str(recipe), item, "--runs-dir", str(runs)), needle, runs)


@pytest.mark.parametrize("override,needle", [
    ({"report.wandb": {"project": "p", "mode": "offline"}}, "recipe key report.wandb: the wandb package is not "
                                                            "installed; pip install wandb"),
    ({"report.tensorboard": True}, "recipe key report.tensorboard: the tensorboard package is not installed; "
                                   "pip install tensorboard"),
])
def test_a_metrics_sink_without_its_package_is_refused_at_the_start(tmp_path, override, needle):
    """The package is made unimportable in the real command's process (sys.modules[name] = None)."""
    recipe = write_recipe(tmp_path, recipe_dict(**{**SMALL, **override}))
    runs = tmp_path / "runs"
    hide = "wandb" if "report.wandb" in override else "tensorboard"
    program = (f"import sys; sys.modules[{hide!r}] = None; sys.argv[0] = 'miniverl'; "
               "from miniverl.engine.cli.app import main; main()")
    for args in (["run", str(recipe), "--runs-dir", str(runs)], ["run", str(recipe), "--dry-run"]):
        result = subprocess.run([sys.executable, "-c", program, *args], capture_output=True, text=True, timeout=300)
        _assert_user_error(result, needle, runs)


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
    _assert_user_error(result, "tokenizers differ", tmp_path / "runs")


def test_vocab_size_mismatch_is_refused(tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(ASSETS_DIR / "protocol_teacher", teacher)
    config = json.loads((teacher / "config.json").read_text())
    config["vocab_size"] = 300  # below the 397-token tokenizer
    (teacher / "config.json").write_text(json.dumps(config))
    recipe = write_recipe(tmp_path, recipe_dict(**{**SMALL, "models.teacher.path": str(teacher)}))
    _assert_user_error(miniverl("run", str(recipe), "--runs-dir", str(tmp_path / "runs")),
                       "smaller than the tokenizer", tmp_path / "runs")


def test_malformed_yaml_and_non_mapping(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    _assert_user_error(miniverl("run", str(bad), "--runs-dir", str(tmp_path / "runs")), "not valid YAML")
    bad.write_text("- just\n- a list\n")
    _assert_user_error(miniverl("run", str(bad), "--runs-dir", str(tmp_path / "runs")), "YAML mapping")


def test_existing_run_id_is_not_overwritten(tmp_path):
    (tmp_path / "runs" / "taken").mkdir(parents=True)
    (tmp_path / "runs" / "taken" / "journal.msgpack").write_bytes(b"x")
    recipe = write_recipe(tmp_path, recipe_dict(**SMALL))
    _assert_user_error(miniverl("run", str(recipe), "--run-id", "taken", "--runs-dir", str(tmp_path / "runs")),
                       "already exists")
    assert (tmp_path / "runs" / "taken" / "journal.msgpack").read_bytes() == b"x"


def test_unknown_stage_and_bad_cycle(tmp_path):
    recipe = write_recipe(tmp_path, recipe_dict(**SMALL))
    runs = tmp_path / "runs"
    (runs / "r").mkdir(parents=True)
    (runs / "r" / "journal.msgpack").write_bytes(b"\x82\xa6run_id\xa1r\xa6stages\x80")
    (runs / "r" / "recipe.yaml").write_text(recipe.read_text())
    _assert_user_error(miniverl("stage", "r", "polish", "--runs-dir", str(runs)), "unknown stage 'polish'")
    _assert_user_error(miniverl("stage", "r", "rollout", "--cycle", "9", "--runs-dir", str(runs)), "out of range")
    _assert_user_error(miniverl("stage", "r", "gradient", "--runs-dir", str(runs)), "needs --cycle")


def test_unknown_run_and_bad_run_id(tmp_path):
    _assert_user_error(miniverl("resume", "nope", "--runs-dir", str(tmp_path)), "no run nope")
    _assert_user_error(miniverl("resume", "../etc", "--runs-dir", str(tmp_path)), "not allowed")
    _assert_user_error(miniverl("resume", "a/b", "--runs-dir", str(tmp_path)), "not allowed")
    recipe = write_recipe(tmp_path, recipe_dict(**SMALL))
    _assert_user_error(miniverl("run", str(recipe), "--run-id", "..", "--runs-dir", str(tmp_path / "runs")), "not allowed")
    _assert_user_error(miniverl("stage", "nope", "rollout", "--runs-dir", str(tmp_path)), "no run nope")
