"""The group gradient does not depend on micro-batch size or loss chunk size; OOM retry is exact."""

from __future__ import annotations

import msgspec
import pytest
import torch

from support import SMALL, recipe_dict, write_recipe
from miniverl.engine.core.progress import Reporter
from miniverl.engine.core.recipe import load_recipe
from miniverl.engine.run.commands import prepare
from miniverl.stages import gradient, rollout, teacher_score
from miniverl.engine.tasks.registry import build_task

QUIET = Reporter(enabled=False)


def _replace(recipe, **sections):
    """Recipe with some fields of some sections replaced, e.g. loss={"mode": "exact"}."""
    changes = {name: msgspec.structs.replace(getattr(recipe, name), **fields) for name, fields in sections.items()}
    return msgspec.structs.replace(recipe, **changes)


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([grads[name].flatten().double() for name in sorted(grads)])


@pytest.fixture(scope="module", params=["tiny_calc.yaml", "tiny_sql.yaml"])
def setting(request, tmp_path_factory):
    """A rollout of each built-in task's tiny student (the sql trajectories are longer and query a database)."""
    path = write_recipe(tmp_path_factory.mktemp("grad"), recipe_dict(request.param, **{**SMALL, "train.rollouts_per_cycle": 6}))
    recipe, _ = load_recipe(path)
    host = prepare(recipe)
    adapter = host.initial_adapter()
    gen = torch.Generator().manual_seed(7)
    # LoRA's B starts at zero, which would zero every A gradient: make both matter.
    adapter = {n: t + 0.05 * torch.randn(t.shape, generator=gen) if "lora_B" in n else t for n, t in adapter.items()}
    trajectories = rollout.sample(recipe, host, build_task(recipe.task, {}), adapter, "test", 0, QUIET)
    return recipe, host, adapter, trajectories


@pytest.mark.parametrize("mode,divergence", [("sampled_kl", "reverse_kl"), ("topk_tail", "reverse_kl"),
                                             ("exact", "reverse_kl"), ("exact", "forward_kl"), ("exact", "jsd")])
def test_gradient_invariant_to_micro_batch_and_chunk(setting, mode, divergence):
    recipe, host, adapter, trajectories = setting
    scored = _replace(recipe, loss={"mode": mode, "divergence": divergence, "topk": 8})
    _, teacher = teacher_score.score(scored, host, trajectories, QUIET)
    reference = None
    for batch in (1, 2, 4):
        for chunk in (1000, 37, 8):
            variant = _replace(scored, train={"trajectory_batch_size": batch},
                               loss={"mode": mode, "divergence": divergence, "topk": 8, "chunk_size": chunk},
                               memory={"min_chunk_size": 1})
            grads = gradient.compute(variant, host, trajectories, teacher, adapter, QUIET).grads
            flat = _flat(grads)
            assert torch.isfinite(flat).all() and flat.norm() > 0
            if reference is None:
                reference = flat
                continue
            rel = float((flat - reference).norm() / reference.norm())
            assert rel <= 1e-6, (batch, chunk, rel)


def test_injected_oom_halves_the_chunk_and_gives_the_same_gradient(setting, monkeypatch):
    recipe, host, adapter, trajectories = setting
    recipe = _replace(recipe, loss={"chunk_size": 32}, memory={"min_chunk_size": 4})
    _, teacher = teacher_score.score(recipe, host, trajectories, QUIET)
    clean = gradient.compute(recipe, host, trajectories, teacher, adapter, QUIET).grads
    # The first micro-batch must fill a 16-position chunk for the cap below to bite twice.
    first = trajectories.trajectories[: recipe.train.trajectory_batch_size]
    assert sum(len(t.sampling_logprobs) for t in first) > 16
    # A cap that 32 and 16 positions of logits exceed but 8 fit.
    monkeypatch.setenv("MINIVERL_FAULT_OOM_ABOVE", str(10 * host.vocab_limit))
    retried = []
    result = gradient.compute(recipe, host, trajectories, teacher, adapter, QUIET,
                              on_retry=lambda old, new, err: retried.append((old, new)))
    grads, chunk, attempts = result.grads, result.chunk_size, result.attempts
    assert chunk == 8 and retried == [(32, 16), (16, 8)]
    assert [(a.chunk_size, a.ok) for a in attempts] == [(32, False), (16, False), (8, True)]
    assert "injected" in attempts[0].error
    rel = float((_flat(grads) - _flat(clean)).norm() / _flat(clean).norm())
    assert rel <= 1e-6


def test_oom_below_the_floor_fails_the_stage(setting, monkeypatch):
    from miniverl.engine.core.errors import StageFailed

    recipe, host, adapter, trajectories = setting
    recipe = _replace(recipe, loss={"chunk_size": 64}, memory={"min_chunk_size": 32})
    _, teacher = teacher_score.score(recipe, host, trajectories, QUIET)
    monkeypatch.setenv("MINIVERL_FAULT_OOM_ABOVE", "1")
    with pytest.raises(StageFailed, match="min_chunk_size 32"):
        gradient.compute(recipe, host, trajectories, teacher, adapter, QUIET)
