"""liger-kernel's fused RMSNorm and SiLU·mul in the student's layers while the gradient stage trains.

Hugging Face's Qwen3 RMSNorm keeps a float32 copy of its input for the
backward (twice the bf16 tensor), and its MLP keeps the gate, the up
projection, SiLU(gate) and their product: at 6 x 704 tokens that is most of
the one recomputed layer a checkpointed backward holds. liger's RMSNorm keeps
its input and one rstd a row; its SiLU·mul keeps the gate and up outputs and
recomputes SiLU in the backward; each is one Triton launch where the module
path takes several. The arithmetic is the same function (float32 inside,
rounded once), so the gradient matches the module path to bf16 rounding
(tests/gpu).

Scoped, not liger's own monkey patch: `apply_liger_kernel_to_qwen3` replaces
the transformers classes and functions for every model in the process,
teacher included; here only the given student's module instances change, and
only until the context exits. The peft-wrapped projections stay as they are,
so LoRA trains exactly as before.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator

import torch

from miniverl.engine.models.loading import base_model

RMS_NORMS = ("input_layernorm", "post_attention_layernorm")
HEAD_NORMS = ("q_norm", "k_norm")


def _rms_norm(rms_norm, module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    # casting_mode "llama": float32 inside, the weight applied after rounding to the input dtype, as
    # Qwen3RMSNorm does; not in place, so no gradient buffer another branch reads is overwritten.
    return rms_norm.apply(hidden, module.weight, module.variance_epsilon, 0.0, "llama", False)


def _swiglu_mlp(silu_mul, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module.down_proj(silu_mul.apply(module.gate_proj(x), module.up_proj(x)))


def _patchable(layer: torch.nn.Module) -> bool:
    mlp, attn = getattr(layer, "mlp", None), getattr(layer, "self_attn", None)
    if attn is None or getattr(getattr(mlp, "config", None), "hidden_act", None) not in ("silu", "swish"):
        return False
    return all(hasattr(getattr(layer, n, None), "variance_epsilon") for n in RMS_NORMS) and \
        all(hasattr(getattr(attn, n, None), "variance_epsilon") for n in HEAD_NORMS)


@contextmanager
def fused_training_ops(model: torch.nn.Module, enabled: bool = True) -> Iterator[int]:
    """Route `model`'s RMSNorms and MLPs through liger's kernels inside the block; yields how many layers.

    Layers of another shape (no Qwen3-style q/k norms, another activation) are left alone."""
    if not enabled:
        yield 0
        return
    # Imported here, once a block, not in every forward of every patched module.
    from liger_kernel.ops import LigerRMSNormFunction, LigerSiLUMulFunction

    causal = base_model(model)
    decoder = getattr(causal, "model", causal)
    patched: list[torch.nn.Module] = []
    layers = 0
    try:
        for layer in getattr(decoder, "layers", []):
            if not _patchable(layer):
                continue
            norms = [getattr(layer, n) for n in RMS_NORMS] + [getattr(layer.self_attn, n) for n in HEAD_NORMS]
            for norm in norms:
                norm.forward = functools.partial(_rms_norm, LigerRMSNormFunction, norm)
                patched.append(norm)
            layer.mlp.forward = functools.partial(_swiglu_mlp, LigerSiLUMulFunction, layer.mlp)
            patched.append(layer.mlp)
            layers += 1
        final = getattr(decoder, "norm", None)
        if layers and hasattr(final, "variance_epsilon"):
            final.forward = functools.partial(_rms_norm, LigerRMSNormFunction, final)
            patched.append(final)
        yield layers
    finally:
        for module in patched:
            del module.forward  # the instance attribute; the class's forward shows through again
