"""PEFT directories: peft's save_pretrained output read back, the merge against a float64 reference, refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from miniverl.engine.core.errors import IncompatibleModelsError, UserError
from miniverl.engine.core.recipe import LoraSpec, StudentSpec
from miniverl.engine.export.peft_dir import (
    read_adapter_dir, run_name, save_adapter, save_merged, student_on_cpu,
)
from miniverl.engine.models.loading import ASSETS_DIR, adapter_parameters, attach_lora, load_causal_lm

BASE = ASSETS_DIR / "student_base"
STUDENT = StudentSpec(id="miniverl-builtin/student_base")
LORA = LoraSpec(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def _trained_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """An adapter whose B is not zero, as after training."""
    model = attach_lora(load_causal_lm(BASE, torch.float32, "cpu"), LORA, seed)
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=gen) * 0.05 for name, p in adapter_parameters(model).items()}


def test_peft_names_map_to_the_run_model_names():
    saved = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert run_name(saved) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert run_name(saved.replace("lora_A", "lora_B")) == run_name(saved).replace("lora_A", "lora_B")


def test_a_saved_adapter_reads_back_to_the_same_tensors_and_lora(tmp_path):
    state = _trained_state()
    save_adapter(student_on_cpu(BASE, LORA, state), tmp_path, STUDENT)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(LORA.target_modules)
    found = read_adapter_dir(tmp_path, STUDENT, BASE)
    assert found.lora == LoraSpec(r=4, alpha=8.0, target_modules=sorted(LORA.target_modules))
    assert found.state.keys() == state.keys()
    assert all(torch.equal(found.state[name], state[name]) for name in state)


def test_the_merged_weights_are_the_float64_sum_in_the_bases_dtype(tmp_path):
    bf16_base = tmp_path / "bf16"
    load_causal_lm(BASE, torch.bfloat16, "cpu").save_pretrained(str(bf16_base))
    state = _trained_state(1)
    model = student_on_cpu(bf16_base, LORA, state)
    assert save_merged(model, tmp_path / "merged", bf16_base) == "bfloat16"
    from transformers import AutoModelForCausalLM

    merged = dict(AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).named_parameters())
    base = dict(load_causal_lm(bf16_base, torch.float64, "cpu").named_parameters())
    scale = LORA.alpha / LORA.r
    checked = 0
    for name, a in state.items():
        if ".lora_A." not in name:
            continue
        module = name.removeprefix("base_model.model.").split(".lora_A.")[0]
        b = state[name.replace(".lora_A.", ".lora_B.")]
        expected = base[f"{module}.weight"] + scale * (b.double() @ a.double())
        got = merged[f"{module}.weight"]
        assert got.dtype == torch.bfloat16
        # one bf16 rounding of the exact sum (8 significant bits), nothing more
        assert torch.allclose(got.double(), expected, rtol=2 ** -8, atol=1e-6), module
        checked += 1
    assert checked == 3 * 3  # three target modules in each of the three layers


@pytest.mark.parametrize("change,needle", [
    ({"use_dora": True}, "uses use_dora"),
    ({"modules_to_save": ["lm_head"]}, "uses modules_to_save"),
    ({"target_modules": ".*proj"}, "a regular expression is not supported"),
    ({"peft_type": "IA3"}, "only LoRA adapters"),
    ({"task_type": "SEQ_CLS"}, "a student adapter is CAUSAL_LM"),
    ({"base_model_name_or_path": "Qwen/Qwen3-0.6B"}, "was trained for the base Qwen/Qwen3-0.6B"),
    ({"r": 0}, "has an unusable value"),
])
def test_an_adapter_miniverl_cannot_evaluate_faithfully_is_one_line(tmp_path, change, needle):
    save_adapter(student_on_cpu(BASE, LORA, _trained_state()), tmp_path, STUDENT)
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(UserError) as caught:
        read_adapter_dir(tmp_path, STUDENT, BASE)
    assert needle in str(caught.value) and "\n" not in str(caught.value)
    if "base_model_name_or_path" in change:
        assert isinstance(caught.value, IncompatibleModelsError)


def test_missing_or_unreadable_files_are_one_line(tmp_path):
    with pytest.raises(UserError, match="no such directory"):
        read_adapter_dir(tmp_path / "absent", STUDENT, BASE)
    with pytest.raises(UserError, match="has no adapter_config.json"):
        read_adapter_dir(tmp_path, STUDENT, BASE)
    save_adapter(student_on_cpu(BASE, LORA, _trained_state()), tmp_path, STUDENT)
    weights = tmp_path / "adapter_model.safetensors"
    shutil.move(weights, tmp_path / "adapter_model.bin")
    with pytest.raises(UserError, match="save it again with safetensors"):
        read_adapter_dir(tmp_path, STUDENT, BASE)
    weights.write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="not a readable safetensors file"):
        read_adapter_dir(tmp_path, STUDENT, BASE)


def test_an_adapter_for_the_base_by_path_is_accepted(tmp_path):
    """A user's PEFT adapter names the base by the local directory it was trained from."""
    save_adapter(student_on_cpu(BASE, LORA, _trained_state()), tmp_path, StudentSpec(id=str(Path(BASE))))
    assert read_adapter_dir(tmp_path, STUDENT, BASE).base == str(BASE)
