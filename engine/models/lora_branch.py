"""peft's LoRA branch with a leaner backward, for the gradient stage.

peft computes a LoRA layer as `base(x) + B(A(x.to(A's dtype))) * scaling`: with
a float32 adapter on a bf16 model, autograd then keeps the float32 copy of x
for A's gradient, once per adapted projection. q, k and v each make their own
copy of one input, gate and up another two, and down's input is the MLP's
widest tensor: at 6 x 704 tokens on Qwen3-0.6B that is ~170 MB a layer, more
than the rest of the recomputed layer. `_LoraBranch` does the same arithmetic
(float32 matmuls on the cast input, the product scaled, summed and rounded
in peft's order for the layer's kind) but keeps x itself, which the layer keeps anyway, and the small x·Aᵀ;
the backward casts x again for A's gradient and frees the copy at once. It is
also a handful of launches where the module path takes a dozen.

Scoped to the block, on the given model's own layer instances, and only for
the plain case peft's own forward takes: one active adapter, not merged, not
disabled, no dropout, no DoRA. Anything else keeps peft's forward.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F


class _LoraBranch(torch.autograd.Function):
    """(x·Aᵀ)·Bᵀ·scaling on x cast to the adapter's dtype; returned in `out_dtype`, keeping x, not its cast."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float,
                out_dtype: torch.dtype) -> torch.Tensor:
        xa = F.linear(x.to(a.dtype), a)
        ctx.save_for_backward(x, a, b, xa)
        ctx.scaling = scaling
        return (F.linear(xa, b) * scaling).to(out_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, a, b, xa = ctx.saved_tensors
        g_NO = grad.reshape(-1, grad.shape[-1]).to(b.dtype) * ctx.scaling
        xa_NR = xa.reshape(-1, xa.shape[-1])
        grad_b = g_NO.T @ xa_NR if ctx.needs_input_grad[2] else None
        g_NR = g_NO @ b
        grad_a = g_NR.T @ x.reshape(-1, x.shape[-1]).to(a.dtype) if ctx.needs_input_grad[1] else None
        grad_x = (g_NR @ a).to(x.dtype).reshape(x.shape) if ctx.needs_input_grad[0] else None
        return grad_x, grad_a, grad_b, None, None


def _lean_forward(layer: torch.nn.Module, adapter: str, rounds_first: bool, x: torch.Tensor, *args,
                  **kwargs) -> torch.Tensor:
    """peft's two sums: its bitsandbytes layers round the branch to the output's dtype and add there;
    its plain Linear adds in the adapter's dtype and rounds the sum."""
    result = layer.base_layer(x, *args, **kwargs)
    a, b, scaling = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight, layer.scaling[adapter]
    if rounds_first:
        return result + _LoraBranch.apply(x, a, b, scaling, result.dtype)
    return (result + _LoraBranch.apply(x, a, b, scaling, a.dtype)).to(result.dtype)


def _layer_kind(layer: torch.nn.Module) -> bool | None:
    """For the peft LoRA linears this knows: whether the branch is rounded before the sum; else None."""
    from peft.tuners.lora.layer import Linear

    if type(layer) is Linear:
        return False
    try:
        from peft.tuners.lora.bnb import Linear4bit
    except ImportError:  # peft without bitsandbytes
        return None
    return True if type(layer) is Linear4bit else None


def _plain_adapter(layer: torch.nn.Module) -> str | None:
    """The one adapter a peft LoRA layer applies, when its forward is the plain sum; else None."""
    active = list(getattr(layer, "active_adapters", []))
    if len(active) != 1 or getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
        return None
    adapter = active[0]
    if adapter not in layer.lora_A or adapter in getattr(layer, "lora_variant", {}):
        return None
    if getattr(layer, "use_dora", {}).get(adapter, False):
        return None
    if not isinstance(layer.lora_dropout[adapter], torch.nn.Identity):  # dropout 0 is peft's Identity
        return None
    return adapter


@contextmanager
def lean_lora(model: torch.nn.Module) -> Iterator[int]:
    """Every plain LoRA layer of `model` through `_LoraBranch` inside the block; yields how many."""
    patched: list[torch.nn.Module] = []
    try:
        for module in model.modules():
            rounds_first = _layer_kind(module)
            adapter = None if rounds_first is None else _plain_adapter(module)
            if adapter is not None:
                module.forward = functools.partial(_lean_forward, module, adapter, rounds_first)
                patched.append(module)
        yield len(patched)
    finally:
        for module in patched:
            del module.forward
