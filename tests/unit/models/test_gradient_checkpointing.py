"""train.gradient_checkpointing recomputes the student's layers in the backward: same gradient, less memory.

On CPU in float32 the recomputation is the same arithmetic, so the gradient
must match the plain backward to rounding; afterwards the student is back to
a plain eval model (no checkpointing, no hook on its embeddings), so the next
no-grad stage is unaffected. train.offload_activations moves exactly the kept
layer inputs through host copies: the gradient must be bit-identical.
"""

from __future__ import annotations

import msgspec
import pytest
import torch
import yaml

from support import SMALL, recipe_dict
from miniverl.engine.models import loading
from miniverl.engine.models.loading import base_model
from miniverl.engine.core.progress import Reporter
from miniverl.engine.core.recipe import parse_recipe
from miniverl.engine.run.commands import prepare
from miniverl.stages import gradient, rollout, teacher_score
from miniverl.engine.tasks.registry import build_task

QUIET = Reporter(enabled=False)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """Randomly initialised models of the tiny shapes (the trained assets are not needed here)."""
    from miniverl.engine.tiny.models import STUDENT_SPEC, TEACHER_SPEC, asset_dir, build_model, load_tokenizer
    from miniverl.engine.tiny.train import save_model

    root = tmp_path_factory.mktemp("tiny")
    tokenizer = load_tokenizer()
    for name, spec, seed in (("student", STUDENT_SPEC, 1), ("teacher", TEACHER_SPEC, 2)):
        save_model(build_model(spec, tokenizer, seed), asset_dir("tokenizer"), root / name)
    return root


def test_checkpointing_gives_the_same_gradient(tiny_dirs, monkeypatch):
    data = recipe_dict(**{**SMALL, "train.rollouts_per_cycle": 4, "train.trajectory_batch_size": 2,
                          "models.student.id": "test/student", "models.student.path": str(tiny_dirs / "student"),
                          "models.teacher.id": "test/teacher", "models.teacher.path": str(tiny_dirs / "teacher")})
    recipe = parse_recipe(yaml.safe_dump(data))
    assert recipe.train.gradient_checkpointing is False  # the default; tiny_calc leaves it off
    host = prepare(recipe)
    adapter = host.initial_adapter()
    gen = torch.Generator().manual_seed(0)
    adapter = {n: t + 0.05 * torch.randn(t.shape, generator=gen) if "lora_B" in n else t for n, t in adapter.items()}
    trajectories = rollout.sample(recipe, host, build_task(recipe.task, {}), adapter, "test", 0, QUIET)
    _, scores = teacher_score.score(recipe, host, trajectories, QUIET)
    results = {}
    offloaded: list[tuple[int, ...]] = []
    real_to_host = loading._to_host

    def counting_to_host(tensor):
        offloaded.append(tuple(tensor.shape))
        return real_to_host(tensor)

    monkeypatch.setattr(loading, "_to_host", counting_to_host)
    for enabled, offload in ((False, False), (True, False), (True, True)):
        variant = msgspec.structs.replace(recipe, train=msgspec.structs.replace(
            recipe.train, gradient_checkpointing=enabled, offload_activations=offload))
        result = gradient.compute(variant, host, trajectories, scores, adapter, QUIET)
        grads, stats = result.grads, result.stats
        results[enabled, offload] = (torch.cat([grads[n].flatten() for n in sorted(grads)]), stats.loss_sum)
        causal = base_model(host.student())
        assert not causal.training and not getattr(causal, "_require_grads_hooks", None)
        assert not any(getattr(m, "gradient_checkpointing", False) for m in causal.modules())
    plain, checkpointed = results[False, False][0], results[True, False][0]
    assert plain.norm() > 0
    assert float((checkpointed - plain).norm() / plain.norm()) <= 1e-6
    assert results[True, False][1] == pytest.approx(results[False, False][1], rel=1e-6)
    assert torch.equal(results[True, True][0], checkpointed) and results[True, True][1] == results[True, False][1]
    # Only the offloading run copied, and only each layer's input: one [batch, length, hidden] per layer
    # per micro-batch (2 micro-batches of 2 here).
    config = base_model(host.student()).config
    assert len(offloaded) == 2 * config.num_hidden_layers
    assert all(len(shape) == 3 and shape[0] == 2 and shape[2] == config.hidden_size for shape in offloaded)


def test_the_lean_lora_branch_gives_peft_gradient(tiny_dirs, monkeypatch):
    """stages.gradient trains through lora_branch.lean_lora; peft's own forward must give the same gradient."""
    import contextlib

    data = recipe_dict(**{**SMALL, "train.rollouts_per_cycle": 2, "train.trajectory_batch_size": 2,
                          "train.gradient_checkpointing": True,
                          "models.student.id": "test/student", "models.student.path": str(tiny_dirs / "student"),
                          "models.teacher.id": "test/teacher", "models.teacher.path": str(tiny_dirs / "teacher")})
    recipe = parse_recipe(yaml.safe_dump(data))
    host = prepare(recipe)
    gen = torch.Generator().manual_seed(1)
    adapter = {n: t + 0.05 * torch.randn(t.shape, generator=gen) if "lora_B" in n else t
               for n, t in host.initial_adapter().items()}
    trajectories = rollout.sample(recipe, host, build_task(recipe.task, {}), adapter, "test", 0, QUIET)
    _, scores = teacher_score.score(recipe, host, trajectories, QUIET)
    counted = []
    real_lean = gradient.lean_lora

    @contextlib.contextmanager
    def counting(model):
        with real_lean(model) as patched:
            counted.append(patched)
            yield patched

    monkeypatch.setattr(gradient, "lean_lora", counting)
    lean = gradient.compute(recipe, host, trajectories, scores, adapter, QUIET)
    monkeypatch.setattr(gradient, "lean_lora", lambda model: contextlib.nullcontext(0))
    peft_path = gradient.compute(recipe, host, trajectories, scores, adapter, QUIET)
    config = base_model(host.student()).config
    assert counted == [7 * config.num_hidden_layers]  # every adapted projection of every layer
    flat = {k: torch.cat([r.grads[n].flatten() for n in sorted(r.grads)]) for k, r in (("lean", lean), ("peft", peft_path))}
    assert flat["peft"].norm() > 0
    assert float((flat["lean"] - flat["peft"]).norm() / flat["peft"].norm()) <= 1e-6
    assert lean.stats.loss_sum == pytest.approx(peft_path.stats.loss_sum, rel=1e-6)
