"""peft's LoRA branch with a leaner backward, for the gradient stage.

peft computes a LoRA layer as `base(x) + B(A(x.to(A's dtype))) * scaling`: with
a float32 adapter on a bf16 model, autograd then keeps the float32 copy of x
for A's gradient, once per adapted projection. q, k and v each make their own
copy of one input, gate and up another two, and down's input is the MLP's
widest tensor: at 6 x 704 tokens on Qwen3-0.6B that is ~170 MB a layer, more
than the rest of the recomputed layer. `_LoraBranch` does the same arithmetic
(float32 matmuls on the cast input, the product scaled, summed and rounded
in peft's order for the layer's kind) but keeps x itself, which the layer keeps anyway, and the small x·Aᵀ;
the backward casts x again for A's gradient, a slice of rows at a time
(`SLICE_BYTES`), as it does the other float32 temporaries. It is also a
handful of launches where the module path takes a dozen.

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


# The float32 temporaries (x cast to the adapter's dtype, the incoming gradient cast, the gradient of x
# before its rounding) are made this many bytes at a time, in equal slices of rows: at 6 x 704 tokens
# down_proj's cast input alone is 50 MB, and the gradient stage's peak sits in that backward.
SLICE_BYTES = 32 * 2**20


def _slices(rows: int, width: int) -> list[slice]:
    count = max(1, -(-rows * width * 4 // SLICE_BYTES))
    step = -(-rows // count)
    return [slice(lo, min(lo + step, rows)) for lo in range(0, rows, step)]


class _LoraBranch(torch.autograd.Function):
    """(x·Aᵀ)·Bᵀ·scaling on x cast to the adapter's dtype; returned in `out_dtype`, keeping x, not its cast."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float,
                out_dtype: torch.dtype) -> torch.Tensor:
        x_NI = x.reshape(-1, x.shape[-1])
        parts = _slices(x_NI.shape[0], x_NI.shape[1])
        if len(parts) == 1:
            xa_NR = F.linear(x_NI.to(a.dtype), a)
        else:
            xa_NR = torch.empty(x_NI.shape[0], a.shape[0], dtype=a.dtype, device=x.device)
            for part in parts:
                xa_NR[part] = F.linear(x_NI[part].to(a.dtype), a)
        ctx.save_for_backward(x, a, b, xa_NR)
        ctx.scaling = scaling
        if out_dtype == a.dtype:  # summed in the adapter's dtype by the caller: no rounding here to slice
            out_NO = F.linear(xa_NR, b) * scaling
        else:  # rounded here: the float32 product need only exist a slice at a time
            out_NO = torch.empty(x_NI.shape[0], b.shape[0], dtype=out_dtype, device=x.device)
            for part in _slices(x_NI.shape[0], b.shape[0]):
                out_NO[part] = F.linear(xa_NR[part], b).mul_(scaling)
        return out_NO.reshape(*x.shape[:-1], b.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, a, b, xa_NR = ctx.saved_tensors
        x_NI, grad_NO = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        want_x, want_a, want_b = ctx.needs_input_grad[:3]
        grad_a = torch.zeros_like(a) if want_a else None
        grad_b = torch.zeros_like(b) if want_b else None
        grad_x_NI = torch.empty_like(x_NI) if want_x else None
        for part in _slices(x_NI.shape[0], max(x_NI.shape[1], grad_NO.shape[1])):
            g_NO = grad_NO[part].to(b.dtype) * ctx.scaling
            if want_b:
                grad_b.addmm_(g_NO.T, xa_NR[part])
            g_NR = g_NO @ b
            if want_a:
                grad_a.addmm_(g_NR.T, x_NI[part].to(a.dtype))
            if want_x:
                grad_x_NI[part] = g_NR @ a
        return (grad_x_NI.reshape(x.shape) if want_x else None), grad_a, grad_b, None, None


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
