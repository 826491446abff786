"""The dry run refuses exactly what the real run refuses before it loads a weight.

Each case breaks one thing (a recipe key, a copy of an embedded tiny model's
config, weights or tokenizer, a real peft adapter) and checks both sides: the
dry run lists the problem, and the real run's own path (`load_recipe`, then
`prepare`, as `start_run` calls them) raises a UserError with the same line.
A recipe one side accepts, the other accepts too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch

from support import SMALL, miniverl, recipe_dict, write_recipe
from miniverl.engine.checks.dry_run import DryRunReport, dry_run, to_json
from miniverl.engine.core.atomic_io import sha256_file
from miniverl.engine.core.errors import IncompatibleModelsError, RecipeError, UserError
from miniverl.engine.core.recipe import LoraSpec, load_recipe
from miniverl.engine.models.loading import ASSETS_DIR, attach_lora, load_causal_lm
from miniverl.engine.run.commands import prepare

SHARED_BASE = "miniverl-builtin/protocol_teacher"


def real_refusal(path: Path) -> UserError:
    """What `miniverl run` raises for this recipe before a run directory exists."""
    with pytest.raises(UserError) as info:
        recipe, _ = load_recipe(path)
        prepare(recipe)
    return info.value


def both_sides(tmp_path: Path, data: dict) -> tuple[DryRunReport, UserError]:
    path = write_recipe(tmp_path, data)
    return dry_run(path), real_refusal(path)


def copy_model(tmp_path: Path, name: str, edit: Callable[[Path], None]) -> Path:
    directory = tmp_path / name
    shutil.copytree(ASSETS_DIR / name, directory)
    edit(directory)
    return directory


def edit_config(**changes) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                config.pop(key)
            else:
                config[key] = value
        (directory / "config.json").write_text(json.dumps(config))
    return edit


def broken_teacher(tmp_path: Path, edit: Callable[[Path], None]) -> dict:
    return recipe_dict(**{**SMALL, "models.teacher.path": str(copy_model(tmp_path, "protocol_teacher", edit))})


def broken_student(tmp_path: Path, edit: Callable[[Path], None]) -> dict:
    return recipe_dict(**{**SMALL, "models.student.path": str(copy_model(tmp_path, "student_base", edit))})


# ---------------------------------------------------------------- refusals of the recipe and of this machine
RECIPE_FAULTS = {
    "out-of-range value": ({"loss.chunk_size": 0}, "loss.chunk_size"),
    "rule spanning keys": ({"memory.min_chunk_size": 512}, "memory.min_chunk_size"),
    "dtype this device lacks": ({"dtype": "bfloat16"}, "recipe key dtype"),
    "nf4 without CUDA": ({"models.student.quantization": "nf4"}, "models.student.quantization"),
    "8-bit optimizer without CUDA": ({"optimizer.name": "paged_adamw_8bit"}, "optimizer.name"),
    "offload without checkpointing": ({"train.offload_activations": True}, "train.offload_activations"),
    "fused kernels without CUDA": ({"train.fused_kernels": True}, "train.fused_kernels"),
    "unknown embedded model": ({"models.teacher.id": "miniverl-builtin/absent"}, "no embedded model"),
    "model directory without config": ({"models.teacher.path": "/nonexistent/model"}, "has no config.json"),
}


@pytest.mark.parametrize("case", list(RECIPE_FAULTS))
def test_recipe_and_machine_refusals_match(tmp_path, case):
    overrides, needle = RECIPE_FAULTS[case]
    report, refusal = both_sides(tmp_path, recipe_dict(**{**SMALL, **overrides}))
    assert needle in str(refusal)
    assert report.problems == [str(refusal)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where PyTorch cannot use CUDA")
def test_cuda_requested_without_cuda(tmp_path):
    report, refusal = both_sides(tmp_path, recipe_dict(**{**SMALL, "models.device": "cuda"}))
    assert isinstance(refusal, RecipeError) and "models.device: cuda requested" in str(refusal)
    assert report.problems == [str(refusal)]


# ---------------------------------------------------------------- refusals of the model directories
def _garbage(name: str, text: str = "{not json") -> Callable[[Path], None]:
    return lambda directory: (directory / name).write_text(text)


def _remove(name: str) -> Callable[[Path], None]:
    return lambda directory: (directory / name).unlink()


def _extra_token(directory: Path) -> None:
    spec = json.loads((directory / "tokenizer.json").read_text())
    spec["added_tokens"].append({**spec["added_tokens"][-1], "id": 397, "content": "<extra>"})
    (directory / "tokenizer.json").write_text(json.dumps(spec))


MODEL_FAULTS = {
    "config not JSON": (broken_teacher, _garbage("config.json"), UserError, "is not readable JSON"),
    "not a causal LM": (broken_teacher, edit_config(architectures=["Qwen3Model"]), UserError, "is not a causal LM"),
    "model_type transformers lacks": (broken_teacher, edit_config(model_type="no_such_model"), UserError,
                                      "no causal-LM class"),
    "config without vocab_size": (broken_teacher, edit_config(vocab_size=None), UserError, "no integer vocab_size"),
    "no safetensors weights": (broken_teacher, _remove("model.safetensors"), UserError, "no *.safetensors weights"),
    "corrupt safetensors header": (broken_teacher, _garbage("model.safetensors", "short"), UserError,
                                   "header in"),
    "student tokenizer does not load": (broken_student, _garbage("tokenizer.json"), UserError,
                                        "tokenizer in"),
    "teacher without tokenizer files": (broken_teacher, _remove("tokenizer.json"), UserError, "no tokenizer files"),
    "tokenizers differ": (broken_teacher, _extra_token, IncompatibleModelsError, "tokenizers differ"),
    "vocabulary below the tokenizer": (broken_teacher, edit_config(vocab_size=300), IncompatibleModelsError,
                                       "smaller than the tokenizer"),
}


@pytest.mark.parametrize("case", list(MODEL_FAULTS))
def test_model_refusals_match(tmp_path, case):
    build, edit, error, needle = MODEL_FAULTS[case]
    report, refusal = both_sides(tmp_path, build(tmp_path, edit))
    assert type(refusal) is error and needle in str(refusal), refusal
    assert report.problems == [str(refusal)]


def test_lora_target_matching_no_module(tmp_path):
    """peft trains the modules that do match and drops a typo silently; both sides refuse it instead."""
    data = recipe_dict(**{**SMALL, "models.student.lora.target_modules": ["q_proj", "qq_proj"]})
    report, refusal = both_sides(tmp_path, data)
    assert isinstance(refusal, RecipeError) and "target_modules: qq_proj match no module" in str(refusal)
    assert report.problems == [str(refusal)]
    # peft's own rule: a target may also name a module by a longer dotted suffix.
    good = write_recipe(tmp_path, recipe_dict(**{**SMALL, "models.student.lora.target_modules": ["self_attn.q_proj"]}))
    assert dry_run(good).problems == []
    prepare(load_recipe(good)[0])


# ---------------------------------------------------------------- shared_backbone and its teacher adapter
@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    """A real peft LoRA over the tiny protocol teacher, saved as peft saves adapters."""
    directory = tmp_path_factory.mktemp("adapter") / "teacher-adapter"
    model = attach_lora(load_causal_lm(ASSETS_DIR / "protocol_teacher", torch.float32, "cpu"), LoraSpec(r=2), seed=1)
    model.save_pretrained(str(directory))
    return directory


def shared_recipe(adapter: Path, **adapter_overrides) -> dict:
    spec = {"path": str(adapter), "base_id": SHARED_BASE,
            "sha256": sha256_file(adapter / "adapter_model.safetensors"), **adapter_overrides}
    return recipe_dict(**{**SMALL, "models.runtime": "shared_backbone", "models.student.id": SHARED_BASE,
                          "models.teacher.id": SHARED_BASE, "models.teacher.adapter": spec})


def test_a_good_shared_recipe_passes_both_and_the_hash_is_compared_as_the_run_does(tmp_path, adapter_dir):
    digest = sha256_file(adapter_dir / "adapter_model.safetensors")
    for sha256 in (digest, digest.upper()):  # the run compares hex digests case-insensitively
        path = write_recipe(tmp_path, shared_recipe(adapter_dir, sha256=sha256))
        report = dry_run(path)
        assert report.problems == []
        assert report.adapters.teacher.sha256 == digest
        assert prepare(load_recipe(path)[0]).teacher_adapter.sha256 == digest


def _without_config(tmp_path: Path, adapter: Path) -> Path:
    bare = tmp_path / "weights-only"
    bare.mkdir()
    shutil.copyfile(adapter / "adapter_model.safetensors", bare / "adapter_model.safetensors")
    return bare


ADAPTER_FAULTS = {
    "path holds no adapter": (lambda tmp, a: {"path": str(tmp / "absent")}, UserError, "adapter.path"),
    "no adapter_config.json": (lambda tmp, a: {"path": str(_without_config(tmp, a))}, UserError, "adapter.path"),
    "another base id": (lambda tmp, a: {"base_id": "Qwen/Qwen3-0.6B"}, IncompatibleModelsError, "adapter.base_id"),
    "another base revision": (lambda tmp, a: {"base_revision": "c1899de2"}, IncompatibleModelsError,
                              "adapter.base_id"),
    "sha256 missing": (lambda tmp, a: {"sha256": None}, UserError, "adapter.sha256: missing"),
    "sha256 differs": (lambda tmp, a: {"sha256": "f" * 64}, IncompatibleModelsError, "not the recorded"),
}


@pytest.mark.parametrize("case", list(ADAPTER_FAULTS))
def test_teacher_adapter_refusals_match(tmp_path, adapter_dir, case):
    overrides, error, needle = ADAPTER_FAULTS[case]
    report, refusal = both_sides(tmp_path, shared_recipe(adapter_dir, **overrides(tmp_path, adapter_dir)))
    assert type(refusal) is error and needle in str(refusal), refusal
    assert report.problems == [str(refusal)]


def test_shared_backbone_needs_one_base_directory(tmp_path, adapter_dir):
    data = shared_recipe(adapter_dir)
    data["models"]["student"]["path"] = str(copy_model(tmp_path, "protocol_teacher", lambda d: None))
    report, refusal = both_sides(tmp_path, data)
    assert isinstance(refusal, IncompatibleModelsError) and "shared_backbone loads one base" in str(refusal)
    assert report.problems == [str(refusal)]


def test_dual_model_refuses_a_teacher_adapter_it_would_ignore(tmp_path, adapter_dir):
    data = shared_recipe(adapter_dir)
    data["models"].update(runtime="dual_model")
    data["models"]["student"]["id"] = "miniverl-builtin/student_base"
    report, refusal = both_sides(tmp_path, data)
    assert isinstance(refusal, RecipeError) and "dual_model never loads a teacher adapter" in str(refusal)
    assert report.problems == [str(refusal)]


# ---------------------------------------------------------------- through the CLI, as a user meets them
def _error_lines(result) -> list[str]:
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    return [line for line in result.stderr.splitlines() if line.strip()]


def test_the_cli_dry_run_and_run_print_the_same_refusal(tmp_path):
    path = write_recipe(tmp_path, broken_teacher(tmp_path, _extra_token))
    dry = miniverl("run", str(path), "--dry-run", "--json")
    runs = tmp_path / "runs"
    real = miniverl("run", str(path), "--runs-dir", str(runs))
    assert _error_lines(dry) == _error_lines(real) and len(_error_lines(real)) == 1
    assert json.loads(dry.stdout)["problems"] == [_error_lines(real)[0].removeprefix("error: ")]
    assert not runs.exists() or not any(runs.iterdir())


def test_the_cli_dry_run_refuses_what_prepare_refuses(tmp_path):
    """A checkpoint without an LM head: before, the dry run refused it and the run failed later, loading weights."""
    path = write_recipe(tmp_path, broken_teacher(tmp_path, edit_config(architectures=["Qwen3Model"])))
    dry = miniverl("run", str(path), "--dry-run")
    assert _error_lines(dry) == [f"error: {real_refusal(path)}"]
    assert "no weights are loaded" in dry.stdout and "config readable" in dry.stdout


def test_json_is_the_msgspec_encoding_of_the_report(tmp_path):
    path = write_recipe(tmp_path, recipe_dict(**SMALL))
    report = dry_run(path)
    document = json.loads(to_json(report))
    assert list(document) == ["recipe", "resolved", "models", "tokenizer", "adapters", "memory", "problems", "note"]
    assert document["tokenizer"]["tokenizer_size"] == 397 and document["adapters"]["teacher"] == {"kind": "none"}
    assert [m["role"] for m in document["models"]] == ["student", "teacher"]
