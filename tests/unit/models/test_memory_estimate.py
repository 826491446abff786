"""The analytic memory estimate against things counted independently.

Tensor shapes against files written by safetensors itself; parameter counts
and LoRA counts against real transformers / peft models built from the same
config; the KV-cache term against a real cache's bytes; and every budget the
recipe fixes moving the terms it should, by the factor it should.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from support import ROOT
from miniverl.engine.core.recipe import Recipe, parse_recipe
from miniverl.engine.models.loading import ASSETS_DIR
from miniverl.engine.models.memory_estimate import (
    StageEstimate, checkpoint_tensors, estimate, lora_parameters, model_shape, parameter_counts,
)

STUDENT_CONFIG = json.loads((ASSETS_DIR / "student_base" / "config.json").read_text())
TEACHER_CONFIG = json.loads((ASSETS_DIR / "protocol_teacher" / "config.json").read_text())
RECIPE = yaml.safe_load((ROOT / "recipes" / "tiny_calc.yaml").read_text())


# ---------------------------------------------------------------- safetensors headers
def test_checkpoint_tensors_reads_every_shard_header(tmp_path):
    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5), "scalar": torch.tensor(1.0)},
              tmp_path / "model-00001-of-00002.safetensors")
    save_file({"c": torch.zeros(2, 3, 4, dtype=torch.bfloat16), "empty": torch.zeros(0, 7)},
              tmp_path / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    assert checkpoint_tensors(tmp_path) == {"a": 12, "b": 5, "scalar": 1, "c": 24, "empty": 0}
    assert checkpoint_tensors(tmp_path / "absent") is None
    (tmp_path / "weightless").mkdir()
    assert checkpoint_tensors(tmp_path / "weightless") is None


def test_checkpoint_tensors_of_the_tiny_student_equal_its_loaded_tensors():
    path = ASSETS_DIR / "student_base" / "model.safetensors"
    assert checkpoint_tensors(path.parent) == {name: t.numel() for name, t in load_file(path).items()}


# ---------------------------------------------------------------- parameter counts
def _real_model(config: dict):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))


@pytest.mark.parametrize("changes", [
    {},  # the shipped tiny student: Qwen3, tied embeddings
    {"tie_word_embeddings": False},
    {"attention_bias": True},  # Qwen3 then biases q, k, v and o
    {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},  # q, k, v biases whatever attention_bias says
    {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "attention_bias": True},
], ids=["qwen3", "untied", "qwen3-bias", "qwen2", "llama-bias"])
def test_parameter_counts_equal_a_real_model_from_the_same_config(changes):
    config = {**STUDENT_CONFIG, **changes}
    model = _real_model(config)
    total, linear = parameter_counts(model_shape(config))
    assert total == sum(p.numel() for p in model.parameters())  # parameters() counts a tied weight once
    assert linear == sum(m.weight.numel() for name, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) and ".layers." in name)


def test_the_teacher_config_counts_equal_its_checkpoint():
    total, _ = parameter_counts(model_shape(TEACHER_CONFIG))
    assert total == sum(checkpoint_tensors(ASSETS_DIR / "protocol_teacher").values())


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"]])
def test_lora_parameters_equal_peft_trainable_parameters(targets):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_real_model(STUDENT_CONFIG), peft.LoraConfig(r=4, target_modules=targets))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_parameters(model_shape(STUDENT_CONFIG), targets, 4) == trainable


# ---------------------------------------------------------------- the per-stage estimate
def _recipe(**overrides) -> Recipe:
    data = copy.deepcopy(RECIPE)
    for dotted, value in overrides.items():
        node = data
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return parse_recipe(yaml.safe_dump(data))


def _stages(recipe: Recipe, device: str = "cpu", dtype: str = "float32", optimizer: str = "adamw",
            strategy: str = "resident") -> dict[str, StageEstimate]:
    student, teacher = model_shape(STUDENT_CONFIG), model_shape(TEACHER_CONFIG)
    return {s.stage: s for s in estimate(recipe, student, teacher, device, dtype, optimizer, strategy)}


def test_the_kv_cache_term_equals_a_real_cache():
    """verify's KV term is the bytes of the cache a real forward over max_total_tokens x batch leaves."""
    recipe = _recipe(**{"rollout.max_total_tokens": 24, "rollout.max_new_tokens_per_turn": 8, "verify.batch_size": 3})
    model = _real_model(STUDENT_CONFIG)
    with torch.no_grad():
        out = model(torch.zeros(3, 24, dtype=torch.long), use_cache=True)
    cache = out.past_key_values
    real = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert _stages(recipe)["verify"].kv_cache == real


@pytest.mark.parametrize("overrides,stage,term,factor", [
    # Doubling a budget doubles the terms that are linear in it.
    ({"rollout.max_total_tokens": 384}, "rollout", "kv_cache", 2),
    ({"rollout.max_total_tokens": 384}, "verify", "kv_cache", 2),
    ({"rollout.max_total_tokens": 384}, "gradient", "activations", 2),
    ({"rollout.max_total_tokens": 384}, "teacher_score", "activations", 2),
    ({"rollout.generation_batch_size": 16}, "rollout", "kv_cache", 2),  # vs 8 below: under rollouts_per_cycle
    ({"rollout.generation_batch_size": 16}, "rollout", "chunk_tensors", 2),
    ({"verify.batch_size": 32}, "verify", "kv_cache", 2),  # vs 16 below: under heldout_size
    ({"train.trajectory_batch_size": 16}, "gradient", "activations", 2),
    ({"train.trajectory_batch_size": 16}, "teacher_score", "activations", 2),
])
def test_a_doubled_budget_doubles_its_terms(overrides, stage, term, factor):
    base = {"rollout.generation_batch_size": 8, "verify.batch_size": 16, "train.trajectory_batch_size": 8}
    small = getattr(_stages(_recipe(**base))[stage], term)
    large = getattr(_stages(_recipe(**{**base, **overrides}))[stage], term)
    assert small > 0 and large == factor * small


@pytest.mark.parametrize("overrides,stage,term", [
    ({"loss.chunk_size": 256}, "gradient", "chunk_tensors"),
    ({"loss.chunk_size": 256, "loss.mode": "topk_tail"}, "teacher_score", "chunk_tensors"),
    ({"models.student.lora.r": 16}, "optimizer_step", "adapter"),
    ({"models.student.lora.r": 16}, "gradient", "adapter"),
    ({"models.student.lora.target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"]}, "rollout", "adapter"),  # vs the default's q, v below
])
def test_estimate_grows_with_the_budget(overrides, stage, term):
    base = {"loss.mode": overrides.get("loss.mode", "exact"), "models.student.lora.target_modules": ["q_proj", "v_proj"]}
    before = _stages(_recipe(**base))[stage]
    after = _stages(_recipe(**{**base, **overrides}))[stage]
    assert getattr(after, term) > getattr(before, term) and after.total > before.total


def test_memory_savers_save_memory():
    recipe = _recipe()
    assert _stages(_recipe(**{"train.gradient_checkpointing": True}))["gradient"].activations \
        < _stages(recipe)["gradient"].activations
    assert _stages(recipe, dtype="bfloat16")["rollout"].weights * 2 == _stages(recipe)["rollout"].weights
    cuda = _stages(recipe, device="cuda", dtype="bfloat16")
    swap = _stages(recipe, device="cuda", dtype="bfloat16", strategy="swap")
    assert swap["rollout"].weights < cuda["rollout"].weights and swap["preflight"].weights == cuda["preflight"].weights
    nf4 = _stages(_recipe(**{"models.student.quantization": "nf4"}), device="cuda", dtype="bfloat16")
    assert nf4["rollout"].weights < cuda["rollout"].weights
    paged = _stages(recipe, device="cuda", dtype="bfloat16", optimizer="paged_adamw_8bit")
    assert paged["optimizer_step"].adapter < cuda["optimizer_step"].adapter
    assert all(s.total == s.weights + s.adapter + s.kv_cache + s.activations + s.chunk_tensors + s.runtime
               for s in cuda.values())


# ---------------------------------------------------------------- refusing a plan that can never fit
def _refusal(recipe: Recipe, total_bytes: int, monkeypatch) -> str | None:
    from miniverl.engine.models import memory_estimate

    monkeypatch.setattr(memory_estimate, "total_memory", lambda device: (total_bytes, "this machine has"))
    return memory_estimate.memory_refusal(recipe, {"student": STUDENT_CONFIG, "teacher": TEACHER_CONFIG},
                                          "cpu", "float32", "adamw", "resident")


def test_a_plan_above_all_memory_is_refused_naming_the_key_to_lower(monkeypatch):
    recipe = _recipe(**{"rollout.max_total_tokens": 512, "verify.batch_size": 4096, "task.heldout_size": 4096})
    largest = max(_stages(recipe).values(), key=lambda stage: stage.total)
    assert _refusal(recipe, largest.total, monkeypatch) is None  # exactly all of it: not refused
    line = _refusal(recipe, largest.total - 1, monkeypatch)
    assert line is not None and line.startswith("recipe key rollout.max_total_tokens: the verify stage would need")
    assert "lower rollout.max_total_tokens (with verify.batch_size)" in line and "\n" not in line


def test_a_huge_chunk_is_refused_by_its_own_key(monkeypatch):
    recipe = _recipe(**{"loss.chunk_size": 1_000_000})
    line = _refusal(recipe, 2**30, monkeypatch)
    assert line is not None and line.startswith("recipe key loss.chunk_size: the gradient stage")
