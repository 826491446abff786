"""Optimizer-step: policy checkpoint k plus the group gradient gives checkpoint k+1.

The adapter tensors and the optimizer state are rebuilt from checkpoint k's
files, the gradient is clipped by its global norm, and one AdamW update is
taken (bitsandbytes paged 8-bit AdamW on CUDA, torch AdamW on CPU). Nothing
but the files is read, so a resumed step takes the same update.

reads policy checkpoint k and cycle k's gradient; writes checkpoint k+1.
"""

from __future__ import annotations

import torch

from miniverl.engine.core import layout
from miniverl.engine.core.atomic_io import sha256_file
from miniverl.engine.core.errors import ArtifactError
from miniverl.engine.core.layout import Ref, StageKey
from miniverl.engine.core.recipe import Recipe
from miniverl.stages.contract import Output, StageContext, checkpoint_inputs, checkpoint_outputs, checkpoint_refs

NAME = layout.OPTIMIZER_STEP


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


def step(recipe: Recipe, optimizer_name: str, device: str, adapter: dict[str, torch.Tensor],
         optimizer_tensors: dict[str, torch.Tensor], optimizer_scalars: dict[str, float],
         grads: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float]]:
    """Returns the new adapter and the optimizer state as tensors and scalars."""
    names = sorted(adapter)
    params = [torch.nn.Parameter(adapter[n].to(device=device, dtype=torch.float32).clone()) for n in names]
    optimizer = make_optimizer(optimizer_name, params, recipe)
    restore_state(optimizer, optimizer_tensors, optimizer_scalars)
    for name, param in zip(names, params):
        param.grad = grads[name].to(device=device, dtype=torch.float32).clone()
    max_norm = recipe.optimizer.grad_clip if recipe.optimizer.grad_clip > 0 else float("inf")
    torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)  # the Gradient record holds the norm
    optimizer.step()
    new_adapter = {n: p.detach().cpu().to(adapter[n].dtype).clone() for n, p in zip(names, params)}
    tensors, scalars = flatten_state(optimizer)
    return new_adapter, tensors, scalars


def inputs(key: StageKey, recipe: Recipe) -> dict[str, Ref]:
    return {**checkpoint_inputs(key.cycle), "optimizer": layout.optimizer_ref(key.cycle),
            "gradient": layout.gradient_ref(key.cycle), "grads": layout.gradient_tensors_ref(key.cycle),
            "preflight": layout.preflight_ref()}


def outputs(key: StageKey, recipe: Recipe) -> list[Ref]:
    return checkpoint_refs(key.cycle + 1)


def run(ctx: StageContext, got: dict) -> list[Output]:
    checkpoint, gradient = got["checkpoint"], got["gradient"]
    if gradient.policy_adapter_sha256 != checkpoint.adapter_sha256:
        raise ArtifactError(f"gradient of cycle {ctx.key.cycle} was computed for another policy; rerun gradient")
    optimizer_name = got["preflight"].resolved["optimizer.name"].value
    adapter, tensors, scalars = step(ctx.recipe, optimizer_name, ctx.host.device, got["adapter"], got["optimizer"] or {},
                                     checkpoint.optimizer_scalars, got["grads"])
    base_config = sha256_file(ctx.host.student_dir / "config.json")
    return checkpoint_outputs(ctx.key.cycle + 1, ctx.recipe, base_config, adapter, tensors, scalars)
