"""shared_backbone: one base, a trainable student adapter and a frozen teacher adapter.

The teacher the stages see must compute exactly what the base plus the teacher
adapter computes when loaded on its own, switching back leaves the student
untouched, only the student adapter trains, and the adapter's provenance
(base id, revision, sha256 of its weights) is checked before anything runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support import SMALL, miniverl, recipe_dict, write_recipe
from miniverl.engine.core.errors import IncompatibleModelsError, RecipeError, UserError
from miniverl.engine.models.host import ModelHost
from miniverl.engine.core.atomic_io import sha256_file
from miniverl.engine.models.loading import adapter_parameters, attach_lora, decoder_and_head, load_causal_lm
from miniverl.engine.core.recipe import LoraSpec, parse_recipe

BASE_ID = "test/tiny-base"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """A randomly initialised model of the tiny student's shape, with the embedded tokenizer."""
    from miniverl.engine.tiny.models import STUDENT_SPEC, asset_dir, build_model, load_tokenizer
    from miniverl.engine.tiny.train import save_model

    out = tmp_path_factory.mktemp("base") / "tiny-base"
    save_model(build_model(STUDENT_SPEC, load_tokenizer(), seed=5), asset_dir("tokenizer"), out)
    return out


def make_teacher_adapter(base: Path, directory: Path, seed: int = 123) -> Path:
    """A random LoRA for the tiny base, saved the way peft saves adapters."""
    base = load_causal_lm(base, torch.float32, "cpu")
    model = attach_lora(base, LoraSpec(r=4, alpha=8.0), seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # B starts at zero, which would make the adapter a no-op
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(str(directory))
    return directory / "adapter_model.safetensors"


@pytest.fixture(scope="module")
def adapter_file(tmp_path_factory, base_dir) -> Path:
    return make_teacher_adapter(base_dir, tmp_path_factory.mktemp("teacher_adapter"))


def shared_recipe_dict(base: Path, adapter: Path, **adapter_overrides) -> dict:
    spec = {"path": str(adapter.parent), "base_id": BASE_ID, "sha256": sha256_file(adapter), **adapter_overrides}
    return recipe_dict(**{**SMALL, "models.runtime": "shared_backbone", "train.cycles": 1,
                          "models.student.id": BASE_ID, "models.student.path": str(base),
                          "models.teacher.id": BASE_ID, "models.teacher.path": str(base),
                          "models.teacher.adapter": spec})


def shared_host(base: Path, adapter: Path, **adapter_overrides) -> ModelHost:
    import yaml

    recipe = parse_recipe(yaml.safe_dump(shared_recipe_dict(base, adapter, **adapter_overrides)))
    return ModelHost(recipe, "cpu", "float32", "resident")


def reference_teacher_logits(base: Path, adapter: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """Base + teacher adapter, loaded on their own with peft."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_causal_lm(base, torch.float32, "cpu"), str(adapter.parent)).eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def sample_ids(host: ModelHost) -> torch.Tensor:
    text = "<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>assistant\n"
    return torch.tensor([host.tokenizer(text, add_special_tokens=False).input_ids])


def test_teacher_view_matches_base_plus_teacher_adapter(base_dir, adapter_file):
    host = shared_host(base_dir, adapter_file)
    ids = sample_ids(host)
    want = reference_teacher_logits(base_dir, adapter_file, ids)
    teacher = host.teacher()
    with torch.no_grad():
        full = teacher(input_ids=ids).logits
        body, head_VH = decoder_and_head(teacher)  # the path teacher_score takes
        split = body(input_ids=ids).last_hidden_state @ head_VH.T
        base_logits = load_causal_lm(base_dir, torch.float32, "cpu")(input_ids=ids).logits
    assert torch.allclose(full, want, rtol=0, atol=1e-5)
    assert torch.allclose(split, want, rtol=0, atol=1e-5)
    assert (want - base_logits).abs().max() > 1e-2  # the adapter really changes the model


def test_switching_back_leaves_the_student_alone_and_only_it_trains(base_dir, adapter_file):
    host = shared_host(base_dir, adapter_file)
    ids = sample_ids(host)
    student = host.student()
    trainable = set(adapter_parameters(student))
    assert trainable and all(".default." in name for name in trainable)
    with torch.no_grad():
        before = student(input_ids=ids).logits
        teacher_logits = host.teacher()(input_ids=ids).logits
        after = student(input_ids=ids).logits
    assert torch.equal(before, after)
    assert (before - teacher_logits).abs().max() > 1e-2
    # peft's set_adapter re-flags requires_grad; the host must undo that.
    assert set(adapter_parameters(student)) == trainable
    teacher_params = {n: p for n, p in student.named_parameters() if ".teacher." in n}
    assert teacher_params and not any(p.requires_grad for p in teacher_params.values())
    # A backward through the student reaches its adapter only.
    student.train()
    student(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
    student.eval()
    assert all(p.grad is None for p in teacher_params.values())
    assert all(p.grad is not None for n, p in student.named_parameters() if n in trainable and "lora_A" in n)


@pytest.mark.slow  # a whole pipeline through the CLI
def test_pipeline_runs_on_a_shared_backbone(tmp_path, base_dir, adapter_file):
    """Preflight records the adapter's provenance; teacher_score and gradient use the teacher view."""
    import json

    path = write_recipe(tmp_path, shared_recipe_dict(base_dir, adapter_file))
    result = miniverl("run", str(path), "--run-id", "shared", "--runs-dir", str(tmp_path / "runs"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    manifest = json.loads((tmp_path / "runs" / "shared" / "manifest.json").read_text())
    provenance = manifest["adapter"]["teacher_adapter"]
    assert provenance["sha256"] == sha256_file(adapter_file) and provenance["base_id"] == BASE_ID
    assert manifest["cycles"][0]["positions"] > 0 and manifest["cycles"][0]["grad_norm"] > 0


@pytest.mark.parametrize("overrides,error,needle", [
    ({"sha256": "0" * 64}, IncompatibleModelsError, "models.teacher.adapter.sha256"),
    ({"base_id": "Qwen/Qwen3-0.6B"}, IncompatibleModelsError, "models.teacher.adapter.base_id"),
    ({"base_revision": "c1899de289a04d12100db370d81485cdf75e47ca"}, IncompatibleModelsError,
     "models.teacher.adapter.base_id"),
    ({"sha256": None}, UserError, "models.teacher.adapter.sha256: missing"),
    ({"path": "/nonexistent/adapter"}, UserError, "models.teacher.adapter.path"),
])
def test_provenance_mismatch_is_one_line(base_dir, adapter_file, overrides, error, needle):
    with pytest.raises(error) as info:
        shared_host(base_dir, adapter_file, **overrides)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_wrong_sha256_through_the_cli_is_exit_2(tmp_path, base_dir, adapter_file):
    path = write_recipe(tmp_path, shared_recipe_dict(base_dir, adapter_file, sha256="f" * 64))
    result = miniverl("run", str(path), "--dry-run")
    assert result.returncode == 2
    assert "models.teacher.adapter.sha256" in result.stderr and "Traceback" not in result.stderr


def test_shared_backbone_needs_one_base_revision(base_dir, adapter_file):
    import yaml

    data = shared_recipe_dict(base_dir, adapter_file)
    data["models"]["teacher"]["revision"] = "another-revision"
    with pytest.raises(RecipeError, match="same base"):
        parse_recipe(yaml.safe_dump(data))
