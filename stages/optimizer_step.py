"""Optimizer-step: policy checkpoint k plus the group gradient gives checkpoint k+1.

The adapter tensors and the optimizer state are rebuilt from checkpoint k's
files, the gradient is clipped by its global norm, and one AdamW update is
taken (bitsandbytes paged 8-bit AdamW on CUDA, torch AdamW on CPU). Nothing
but the files is read, so a resumed step takes the same update.
"""

from __future__ import annotations

import torch

from miniverl.engine.core.recipe import Recipe


def make_optimizer(name: str, params: list[torch.Tensor], recipe: Recipe) -> torch.optim.Optimizer:
    o = recipe.optimizer
    kwargs = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    if name == "paged_adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.PagedAdamW8bit(params, **kwargs)
    return torch.optim.AdamW(params, foreach=False, **kwargs)


def flatten_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Optimizer state as safetensors-ready tensors plus plain scalars (no pickle)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, float] = {}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in _flat_items(state):
            name = f"{index}.{key}"
            if torch.is_tensor(value):
                tensors[name] = value.detach().cpu().clone()
            else:
                scalars[name] = float(value)
    return tensors, scalars


def _flat_items(state: dict) -> list[tuple[str, object]]:
    """bitsandbytes nests its quantization state one level down; its loader also takes it flat."""
    items = []
    for key, value in state.items():
        items.extend(value.items() if isinstance(value, dict) else [(key, value)])
    return items


def restore_state(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], scalars: dict[str, float]) -> None:
    if not tensors and not scalars:
        return
    state: dict[int, dict[str, object]] = {}
    for name, value in list(tensors.items()) + list(scalars.items()):
        index, key = name.split(".", 1)
        if key == "step" and not torch.is_tensor(value):
            value = int(value)  # bitsandbytes counts steps in a Python int (torch's AdamW in a tensor)
        state.setdefault(int(index), {})[key] = value
    template = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": template["param_groups"]})


def run(recipe: Recipe, optimizer_name: str, device: str, adapter: dict[str, torch.Tensor],
        optimizer_tensors: dict[str, torch.Tensor], optimizer_scalars: dict[str, float],
        grads: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float], float]:
    """Returns the new adapter, optimizer tensors and scalars, and the pre-clip gradient norm."""
    names = sorted(adapter)
    params = [torch.nn.Parameter(adapter[n].to(device=device, dtype=torch.float32).clone()) for n in names]
    optimizer = make_optimizer(optimizer_name, params, recipe)
    restore_state(optimizer, optimizer_tensors, optimizer_scalars)
    for name, param in zip(names, params):
        param.grad = grads[name].to(device=device, dtype=torch.float32).clone()
    max_norm = recipe.optimizer.grad_clip if recipe.optimizer.grad_clip > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False))
    optimizer.step()
    new_adapter = {n: p.detach().cpu().to(adapter[n].dtype).clone() for n, p in zip(names, params)}
    tensors, scalars = flatten_state(optimizer)
    return new_adapter, tensors, scalars, grad_norm
