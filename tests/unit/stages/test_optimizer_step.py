"""The optimizer step's state round trip: two steps through the state files equal two steps of one optimizer (torch
AdamW here; tests/gpu does paged 8-bit AdamW)."""

from __future__ import annotations

import torch

from support import recipe_dict, write_recipe
from miniverl.engine.core.recipe import load_recipe
from miniverl.stages.optimizer_step import make_optimizer, step


def test_two_steps_through_the_state_files_equal_two_steps_of_one_optimizer(tmp_path):
    recipe, _ = load_recipe(write_recipe(tmp_path, recipe_dict(**{"optimizer.grad_clip": 0.5})))
    gen = torch.Generator().manual_seed(0)
    adapter = {f"layer{i}.lora_A": torch.randn(*shape, generator=gen) for i, shape in enumerate([(4, 8), (8, 4), (3, 7)])}
    grads = [{n: torch.randn(t.shape, generator=gen) for n, t in adapter.items()} for _ in range(2)]
    first, tensors, scalars = step(recipe, "adamw", "cpu", adapter, {}, {}, grads[0])
    second, _, _ = step(recipe, "adamw", "cpu", first, tensors, scalars, grads[1])

    names = sorted(adapter)
    params = [torch.nn.Parameter(adapter[n].clone()) for n in names]
    optimizer = make_optimizer("adamw", params, recipe)
    for g in grads:
        for name, p in zip(names, params):
            p.grad = g[name].clone()
        torch.nn.utils.clip_grad_norm_(params, recipe.optimizer.grad_clip, foreach=False)
        optimizer.step()
    for name, p in zip(names, params):
        assert torch.equal(second[name], p.detach()), name
    assert not torch.equal(second[names[0]], first[names[0]])
