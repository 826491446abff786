"""The CUDA paths: NF4 + LoRA, paged 8-bit AdamW across a resume, swap vs resident, a real OOM.

Skipped where PyTorch cannot use CUDA. Run them on a GPU machine with

    python -m pytest -q -m gpu tests/gpu/test_gpu.py

The models are small random-weight Qwen3s (2 layers) with Qwen3's real tokenizer
and vocabulary (151,669 tokens, 151,936 model rows; tests/fixtures/qwen3/), so a
loss chunk's [C, V] logits weigh what they weigh at the real shapes.
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from qwen3_fixture import make_model_dir
from support import ROOT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device PyTorch can use"),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([grads[n].flatten().double() for n in sorted(grads)])


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu_models")
    return {"student": make_model_dir(root / "student", tiny=True, hidden_size=128, seed=0, dtype="bfloat16"),
            "teacher": make_model_dir(root / "teacher", tiny=True, hidden_size=256, seed=1, dtype="bfloat16")}


def _recipe(tmp_path: Path, model_dirs: dict[str, Path], name: str = "recipe.yaml", **overrides) -> Path:
    data = yaml.safe_load((ROOT / "recipes" / "tiny_calc.yaml").read_text())
    settings = {
        "models.device": "cuda", "models.student.id": "test/student", "models.student.path": str(model_dirs["student"]),
        "models.teacher.id": "test/teacher", "models.teacher.path": str(model_dirs["teacher"]),
        "train.cycles": 1, "train.rollouts_per_cycle": 4, "train.trajectory_batch_size": 2,
        "rollout.max_total_tokens": 320, "rollout.max_new_tokens_per_turn": 160, "rollout.generation_batch_size": 4,
        "task.heldout_size": 2, "verify.max_new_tokens_per_turn": 8, "verify.batch_size": 2,
        "loss.chunk_size": 128, "memory.min_chunk_size": 16, **overrides,
    }
    for dotted, value in settings.items():
        node = data
        keys = dotted.split(".")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _host(recipe_path: Path):
    from miniverl.engine.core.recipe import load_recipe
    from miniverl.engine.run.commands import prepare

    recipe, _ = load_recipe(recipe_path)
    return recipe, prepare(recipe)


def _synthetic(host, n: int = 4, tokens: int = 260):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from qwen_pipeline import synthetic_rollout

    return synthetic_rollout(host, n, tokens)


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- NF4 + LoRA


def test_nf4_lora_backward_reaches_the_adapter_only(tmp_path, model_dirs):
    from miniverl.engine.models.loading import adapter_parameters, attach_lora, is_quantized, load_causal_lm, set_gradient_checkpointing
    from miniverl.engine.core.recipe import LoraSpec

    model = attach_lora(load_causal_lm(model_dirs["student"], torch.bfloat16, "cuda", nf4=True), LoraSpec(r=16, alpha=32.0), 0)
    assert is_quantized(model)
    assert any(type(m).__name__ == "Linear4bit" for m in model.modules())
    params = adapter_parameters(model)
    assert params and all("lora_" in n for n in params)
    with torch.no_grad():
        for name, p in params.items():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    ids = torch.randint(0, 151669, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    grads = {}
    for checkpointing in (False, True):
        model.train()
        set_gradient_checkpointing(model, checkpointing)
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        set_gradient_checkpointing(model, False)
        model.eval()
        grads[checkpointing] = {n: p.grad.detach().clone() for n, p in params.items()}
        for n, p in params.items():
            assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n
            p.grad = None
    for name, param in model.named_parameters():
        if name not in params:
            assert not param.requires_grad and param.grad is None, name
    assert _rel(_flat(grads[True]), _flat(grads[False])) < 1e-2  # checkpointing recomputes, the gradient stays


def test_gradient_stage_execution_options_keep_the_gradient(model_dirs):
    """The gradient stage's lean LoRA branch, liger's kernels and the offloaded checkpoints, on NF4 + LoRA:
    the lean branch's forward is peft's bit for bit, the offload changes nothing at all, and each
    gradient is the module path's to bf16 rounding."""
    from miniverl.engine.models.loading import adapter_parameters, attach_lora, load_causal_lm, set_gradient_checkpointing
    from miniverl.engine.models.lora_branch import lean_lora
    from miniverl.engine.models.training_kernels import fused_training_ops
    from miniverl.engine.core.recipe import LoraSpec

    model = attach_lora(load_causal_lm(model_dirs["student"], torch.bfloat16, "cuda", nf4=True), LoraSpec(r=16, alpha=32.0), 0)
    params = adapter_parameters(model)
    with torch.no_grad():
        for name, p in params.items():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    ids = torch.randint(0, 151669, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        plain_logits = model(input_ids=ids).logits
        with lean_lora(model) as patched:
            assert patched == 7 * model.config.num_hidden_layers
            assert torch.equal(model(input_ids=ids).logits, plain_logits)

    def grads(lean: bool, fused: bool, offload: bool) -> torch.Tensor:
        model.train()
        set_gradient_checkpointing(model, True, offload=offload)
        try:
            with fused_training_ops(model, fused) as layers, (lean_lora(model) if lean else contextlib.nullcontext()):
                assert layers == (model.config.num_hidden_layers if fused else 0)
                model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        finally:
            set_gradient_checkpointing(model, False)
            model.eval()
        flat = _flat({n: p.grad.detach().clone() for n, p in params.items()})
        for p in params.values():
            p.grad = None
        return flat

    module_path = grads(False, False, False)
    lean = grads(True, False, False)
    # Offloading moves the inputs, not the arithmetic: no further from the lean run than a rerun of it is.
    assert _rel(grads(True, False, True), lean) <= 2 * _rel(grads(True, False, False), lean) + 1e-7
    assert _rel(lean, module_path) < 1e-2
    assert _rel(grads(True, True, True), module_path) < 1e-2
    assert not any("forward" in vars(m) for m in model.modules())  # every patch undone


# ----------------------------------------------------------------------------- paged 8-bit AdamW across a resume


def test_paged_adamw8bit_state_survives_save_and_restore():
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    from miniverl.engine.core.recipe import parse_recipe
    from miniverl.stages.optimizer_step import make_optimizer
    from miniverl.stages.optimizer_step import step as optimizer_step

    recipe = parse_recipe((ROOT / "recipes" / "qwen_consumer_gpu_calc.yaml").read_text())
    gen = torch.Generator().manual_seed(0)
    # LoRA-like shapes: big ones take the 8-bit blockwise path, the small one (< 4096) stays 32-bit.
    adapter = {"a.lora_A": torch.randn(16, 1024, generator=gen) * 0.02, "a.lora_B": torch.randn(2048, 16, generator=gen) * 0.02,
               "b.small": torch.randn(16, 8, generator=gen)}
    grads = [{n: torch.randn(t.shape, generator=gen) * 0.1 for n, t in adapter.items()} for _ in range(2)]

    # Uninterrupted: one optimizer, two steps.
    names = sorted(adapter)
    params = [torch.nn.Parameter(adapter[n].cuda().clone()) for n in names]
    optimizer = make_optimizer("paged_adamw_8bit", params, recipe)
    for g in grads:
        for n, p in zip(names, params):
            p.grad = g[n].cuda().clone()
        torch.nn.utils.clip_grad_norm_(params, recipe.optimizer.grad_clip, foreach=False)
        optimizer.step()
    uninterrupted = {n: p.detach().cpu() for n, p in zip(names, params)}

    # The stage: step, save (safetensors bytes + scalars), a fresh process restores, step.
    first, tensors, scalars = optimizer_step(recipe, "paged_adamw_8bit", "cuda", adapter, {}, {}, grads[0])
    assert any(t.dtype == torch.uint8 for t in tensors.values())  # the 8-bit state really is 8-bit
    tensors = st_load(st_save(tensors))
    second, *_ = optimizer_step(recipe, "paged_adamw_8bit", "cuda", first, tensors, scalars, grads[1])
    for n in names:
        assert torch.equal(second[n], uninterrupted[n]), (n, _rel(second[n], uninterrupted[n]))


# ----------------------------------------------------------------------------- swap vs resident


def test_swap_frees_gpu_memory_and_changes_no_result(tmp_path, model_dirs):
    from miniverl.engine.core.progress import Reporter
    from miniverl.stages import gradient, teacher_score

    quiet = Reporter(enabled=False)
    results = {}
    for strategy in ("resident", "swap"):
        _free()
        base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        recipe, host = _host(_recipe(tmp_path, model_dirs, f"{strategy}.yaml", **{"memory.strategy": strategy}))
        assert host.swap == (strategy == "swap")
        host.student()
        student_bytes = torch.cuda.memory_allocated() - base
        host.teacher()
        teacher_stage = torch.cuda.memory_allocated() - base
        reserved_teacher_stage = torch.cuda.memory_reserved() - base_reserved
        teacher_bytes = sum(p.numel() * p.element_size() for p in host._teacher.parameters())
        host.student()
        student_again = torch.cuda.memory_allocated() - base
        print(f"{strategy}: student {student_bytes / 2**20:.1f} MiB, teacher {teacher_bytes / 2**20:.1f} MiB; "
              f"teacher stage allocated {teacher_stage / 2**20:.1f} MiB, reserved {reserved_teacher_stage / 2**20:.1f} "
              f"MiB; student stage again {student_again / 2**20:.1f} MiB")
        if strategy == "swap":
            # The teacher stage holds the teacher alone, and the student's blocks went back to the driver.
            assert teacher_stage < teacher_bytes + student_bytes // 4, (teacher_stage, teacher_bytes, student_bytes)
            assert reserved_teacher_stage < teacher_bytes + student_bytes // 2, reserved_teacher_stage
            assert student_again < student_bytes + teacher_bytes // 4
            assert next(host._teacher.parameters()).device.type == "cpu"
        else:
            assert teacher_stage >= student_bytes + teacher_bytes - 2**20
        rollout = _synthetic(host)
        adapter = {n: t.cpu() for n, t in host.initial_adapter().items()}
        adapter = {n: t + 0.01 if "lora_B" in n else t for n, t in adapter.items()}
        _, scores = teacher_score.score(recipe, host, rollout, quiet)
        grads = gradient.compute(recipe, host, rollout, scores, adapter, quiet).grads
        results[strategy] = (scores["teacher_hidden"], _flat(grads))
        del host
    assert torch.equal(results["swap"][0], results["resident"][0])
    assert _rel(results["swap"][1], results["resident"][1]) <= 1e-6


def test_swap_keeps_an_nf4_student_resident(tmp_path, model_dirs):
    recipe, host = _host(_recipe(tmp_path, model_dirs, **{"memory.strategy": "swap",
                                                          "models.student.quantization": "nf4"}))
    student = host.student()
    host.teacher()
    assert all(p.device.type == "cuda" for p in student.parameters())
    host.student()
    assert next(host._teacher.parameters()).device.type == "cpu"
    del host, student
    _free()


# ----------------------------------------------------------------------------- a real OOM


def test_real_cuda_oom_halves_the_chunk_and_the_manifest_records_it(tmp_path, model_dirs, monkeypatch):
    """A per-process memory cap that chunk 128's logits exceed and chunk 32's fit.

    The cap is calibrated inside the gradient stage of a real pipeline run: the
    stage is first run uncapped at chunk 32 and 128 to measure each one's peak,
    then capped at a fifth of the way from the first peak to the second (chunk
    64 needs about a third of the way), and run for real with the recipe's chunk 128.
    """
    from miniverl.engine.core.progress import Reporter
    from miniverl.engine.distill import losses
    from miniverl.engine.run.commands import start_run
    from miniverl.stages import gradient

    # The unfused loss, whose [C, V] float32 temporaries grow with the chunk: the fused one's chunk is so
    # small beside the activations (91 vs 98 MB at chunks 128 and 32 here) that no cap separates them.
    monkeypatch.setattr(losses, "fused_exact_applies", lambda *args: False)
    real_compute = gradient.compute
    seen = {}

    def capped_compute(recipe, host, rollout, teacher, adapter, reporter, on_retry=None):
        import msgspec

        peaks = {}
        for chunk in (32, 128):
            variant = msgspec.structs.replace(recipe, loss=msgspec.structs.replace(recipe.loss, chunk_size=chunk))
            _free()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            grads = real_compute(variant, host, rollout, teacher, adapter, reporter).grads
            peaks[chunk] = torch.cuda.max_memory_allocated() - start
            seen[f"uncapped_{chunk}"] = _flat(grads)
        _free()
        cap = torch.cuda.memory_reserved() + peaks[32] + (peaks[128] - peaks[32]) // 5
        total = torch.cuda.get_device_properties(0).total_memory
        seen.update(peaks=peaks, cap=cap)
        torch.cuda.set_per_process_memory_fraction(cap / total)
        try:
            return real_compute(recipe, host, rollout, teacher, adapter, reporter, on_retry)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)

    monkeypatch.setattr(gradient, "compute", capped_compute)
    path = _recipe(tmp_path, model_dirs)
    start_run(path, "oom", tmp_path / "runs", Reporter(enabled=False))
    run_dir = tmp_path / "runs" / "oom"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    attempts = [(a["chunk_size"], a["ok"]) for a in manifest["cycles"][0]["attempts"]]
    assert attempts == [(128, False), (64, False), (32, True)], (attempts, seen.get("peaks"), seen.get("cap"))
    assert manifest["oom_retries"] == 2 and manifest["chunk_sizes_used"] == [32]
    assert "CUDA out of memory" in manifest["cycles"][0]["attempts"][0]["error"]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [(e["chunk_size"], e["next_chunk_size"]) for e in events if e["event"] == "oom_retry"] == [(128, 64), (64, 32)]

    from safetensors.torch import load_file

    capped = load_file(str(run_dir / "cycles" / "000000" / "gradient.safetensors"))
    assert _rel(_flat(capped), seen["uncapped_128"]) <= 1e-2  # bf16 tolerance
    assert _rel(_flat(capped), seen["uncapped_32"]) <= 1e-6  # the same chunking: the same arithmetic
