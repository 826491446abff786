"""device/dtype/memory `auto` resolution, with torch.cuda faked so every path runs on a CPU.

No GPU allowlist: any card PyTorch can use is CUDA. bfloat16 needs compute
capability 8.0 or newer (PyTorch reports emulated bf16 as "supported" on
older cards, which must not count); float16 otherwise; float32 on CPU.
"""

from __future__ import annotations

import pytest
import torch

from miniverl.engine.core import device
from miniverl.engine.core.errors import RecipeError


def fake_gpu(monkeypatch, name: str, capability: tuple[int, int], usable: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: capability)
    # What PyTorch answers by default (including_emulation=True): True on a 7.0 card too.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(device, "cuda_problem", lambda: None if usable else "no kernel image for this GPU")


@pytest.mark.parametrize("name,capability,dtype", [
    ("Tesla V100-SXM2-16GB", (7, 0), "float16"),
    ("NVIDIA TITAN V", (7, 0), "float16"),
    ("Tesla T4", (7, 5), "float16"),
    ("NVIDIA GeForce RTX 3070", (8, 6), "bfloat16"),
    ("NVIDIA A100-SXM4-40GB", (8, 0), "bfloat16"),
    ("NVIDIA GeForce RTX 4080", (8, 9), "bfloat16"),
    ("NVIDIA H200", (9, 0), "bfloat16"),
    ("Some Future Card", (12, 0), "bfloat16"),
])
def test_auto_picks_cuda_for_any_card_and_dtype_by_capability(monkeypatch, name, capability, dtype):
    fake_gpu(monkeypatch, name, capability)
    resolved = device.resolve_device("auto")
    assert resolved.value == "cuda" and name in resolved.reason and "auto" in resolved.reason
    chosen = device.resolve_dtype("auto", "cuda")
    assert chosen.value == dtype
    assert f"{capability[0]}.{capability[1]}" in chosen.reason


def test_bfloat16_requested_on_a_card_without_it_is_refused(monkeypatch):
    fake_gpu(monkeypatch, "Tesla V100-SXM2-16GB", (7, 0))
    with pytest.raises(RecipeError, match="recipe key dtype: .*7.0.* no bfloat16"):
        device.resolve_dtype("bfloat16", "cuda")
    assert device.resolve_dtype("float16", "cuda").value == "float16"


def test_cpu_when_pytorch_cannot_use_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    resolved = device.resolve_device("auto")
    assert resolved.value == "cpu" and "is_available() is False" in resolved.reason
    assert device.resolve_dtype("auto", "cpu").value == "float32"
    with pytest.raises(RecipeError, match="recipe key models.device: cuda requested"):
        device.resolve_device("cuda")


def test_a_visible_but_unusable_gpu_falls_back_to_cpu(monkeypatch):
    fake_gpu(monkeypatch, "Card Newer Than This Build", (12, 0), usable=False)
    resolved = device.resolve_device("auto")
    assert resolved.value == "cpu" and "no kernel image" in resolved.reason
    with pytest.raises(RecipeError) as info:
        device.resolve_device("cuda")
    assert "\n" not in str(info.value)


def test_cuda_problem_reports_a_kernel_failure(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def no_kernel(*args, **kwargs):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device\nmore")

    monkeypatch.setattr(torch, "ones", no_kernel)
    assert "no kernel image is available" in device.cuda_problem()


@pytest.mark.parametrize("requested,quantized,value,needle", [
    ("auto", True, "resident", "NF4"),
    ("auto", False, "resident", "swap"),
    ("resident", True, "resident", "requested"),
    ("swap", False, "swap", "CPU memory"),
    ("swap", True, "swap", "NF4 student stays resident"),
])
def test_memory_strategy(requested, quantized, value, needle):
    resolved = device.resolve_memory_strategy(requested, quantized, "cuda")
    assert resolved.value == value and needle in resolved.reason


def test_memory_strategy_on_cpu_is_resident():
    for requested in ("auto", "resident", "swap"):
        assert device.resolve_memory_strategy(requested, False, "cpu").value == "resident"


@pytest.mark.parametrize("requested,checkpointing,where,value,needle", [
    ("auto", True, "cuda", "true", "pinned host memory"),
    ("auto", True, "cpu", "false", "host memory already"),
    ("auto", False, "cuda", "false", "checkpointing is off"),
    (False, True, "cuda", "false", "requested"),
    (True, True, "cpu", "true", "requested"),
])
def test_activation_offload(requested, checkpointing, where, value, needle):
    resolved = device.resolve_activation_offload(requested, checkpointing, where)
    assert resolved.value == value and needle in resolved.reason


def test_activation_offload_without_checkpointing_is_refused():
    with pytest.raises(RecipeError, match="set train.gradient_checkpointing: true"):
        device.resolve_activation_offload(True, False, "cuda")


def test_fused_kernels(monkeypatch):
    assert device.resolve_fused_kernels("auto", "cpu").value == "false"
    assert device.resolve_fused_kernels(False, "cuda").value == "false"
    with pytest.raises(RecipeError, match="needs a CUDA device"):
        device.resolve_fused_kernels(True, "cpu")
    monkeypatch.setattr(device, "_liger_problem", lambda: None)
    assert device.resolve_fused_kernels("auto", "cuda").value == "true"
    assert device.resolve_fused_kernels(True, "cuda").value == "true"
    monkeypatch.setattr(device, "_liger_problem", lambda: "liger-kernel is not installed (pip install liger-kernel)")
    resolved = device.resolve_fused_kernels("auto", "cuda")
    assert resolved.value == "false" and "not installed" in resolved.reason
    with pytest.raises(RecipeError, match="pip install liger-kernel"):
        device.resolve_fused_kernels(True, "cuda")


def test_liger_problem_names_a_missing_or_broken_install(monkeypatch):
    real = device.importlib.util.find_spec
    device._liger_problem.cache_clear()
    monkeypatch.setattr(device.importlib.util, "find_spec", lambda name: None if name == "liger_kernel" else real(name))
    try:
        assert "not installed" in device._liger_problem()
    finally:
        device._liger_problem.cache_clear()


def test_optimizer_auto():
    assert device.resolve_optimizer("auto", "cuda").value == "paged_adamw_8bit"
    assert device.resolve_optimizer("auto", "cpu").value == "adamw"


def test_collect_garbage_frees_cycles_made_after_a_freeze_and_freezes_the_survivors():
    import gc
    import weakref

    from miniverl.engine.core.device import collect_garbage

    class Node:
        pass

    try:
        survivor = Node()
        collect_garbage()  # `survivor` is alive: frozen out of later collections
        frozen = gc.get_freeze_count()
        assert frozen > 0
        first, second = Node(), Node()  # a reference cycle made after the freeze, like a dropped decoder's
        first.other, second.other = second, first
        gone = weakref.ref(first)
        del first, second
        assert gone() is not None  # reference counting alone cannot free a cycle
        collect_garbage()
        assert gone() is None
        assert gc.get_freeze_count() >= frozen and survivor is not None
    finally:
        gc.unfreeze()
