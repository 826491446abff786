"""The MLP of a checkpointed layer recomputed once more, a slice of tokens at a time, in its backward.

A checkpointed layer's backward first recomputes the whole layer, so the
tensors the MLP keeps (the gate and up projections and their SiLU product,
three [tokens, intermediate] tensors) sit beside everything the attention
keeps, and the MLP's gradients come on top: at 6 x 704 tokens on Qwen3-0.6B
that is the largest part of the gradient stage's peak. Here the MLP's forward
runs without keeping anything but its input; its backward reruns the MLP on
`rows` tokens at a time with autograd on and backpropagates each slice, so
its tensors and their gradients exist for one slice only. The cost is one
more MLP forward a layer. The arithmetic is the same per token (the MLP
mixes no tokens), so only summation order differs: each slice adds its share
of the LoRA gradients into `.grad`.

Scoped to the block, on the given model's own MLP instances.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from miniverl.engine.models.loading import base_model

ROWS = 1024  # tokens a slice; a slice's MLP tensors at Qwen3-0.6B: 3 x 1024 x 3072 x 2 bytes = 19 MB


class _SlicedRecompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: Callable[[torch.Tensor], torch.Tensor], rows: int, x: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.rows = run, rows
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        x_NH = x.detach().reshape(-1, x.shape[-1])
        grad_NO = grad.reshape(-1, grad.shape[-1])
        grad_x_NH = torch.empty_like(x_NH)
        with torch.enable_grad():
            for lo in range(0, x_NH.shape[0], ctx.rows):
                part = x_NH[lo : lo + ctx.rows].requires_grad_(True)
                torch.autograd.backward(ctx.run(part), grad_NO[lo : lo + ctx.rows])
                grad_x_NH[lo : lo + ctx.rows] = part.grad
        return None, None, grad_x_NH.reshape(x.shape)


def _sliced_forward(module: torch.nn.Module, run: Callable, rows: int, x: torch.Tensor) -> torch.Tensor:
    # Outside autograd (the checkpoint's no-grad passes, a frozen input) the MLP runs as it is.
    if not torch.is_grad_enabled() or not x.requires_grad:
        return run(x)
    return _SlicedRecompute.apply(run, rows, x)


@contextmanager
def sliced_mlp(model: torch.nn.Module, enabled: bool = True, rows: int = ROWS) -> Iterator[int]:
    """Every decoder layer's `mlp` of `model` through `_SlicedRecompute` inside the block; yields how many.

    Enter it after any context that replaces the MLP's forward (training_kernels.fused_training_ops):
    the slices run whatever forward the MLP had when this one was entered."""
    if not enabled:
        yield 0
        return
    decoder = getattr(base_model(model), "model", None)
    patched: list[tuple[torch.nn.Module, object]] = []
    try:
        for layer in getattr(decoder, "layers", []):
            mlp = getattr(layer, "mlp", None)
            if mlp is None:
                continue
            before = vars(mlp).get("forward")  # an instance forward set by an enclosing context, if any
            mlp.forward = functools.partial(_sliced_forward, mlp, mlp.forward, rows)
            patched.append((mlp, before))
        yield len(patched)
    finally:
        for mlp, before in reversed(patched):
            if before is None:
                del mlp.forward
            else:
                mlp.forward = before
