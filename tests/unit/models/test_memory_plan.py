"""The memory plan: batch sizes and strategy from a budget, at the real Qwen3 shapes (configs only, no weights)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from miniverl.engine.core.artifacts import Resolution
from miniverl.engine.core.errors import RecipeError
from miniverl.engine.core.recipe import load_recipe
from miniverl.engine.models.memory_estimate import Sizes, estimate, model_shape
from miniverl.engine.models.memory_plan import (
    GIB, PLANNED_KEYS, Budget, budget_of, plan_memory, recorded_plan,
)
from support import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "qwen3"
STUDENT = model_shape(json.loads((FIXTURES / "config-Qwen3-0.6B.json").read_text()))
TEACHER = model_shape(json.loads((FIXTURES / "config-Qwen3-1.7B.json").read_text()))
AUTO_STRATEGY = Resolution("resident", "auto: the resolver's reason")
CALC = ROOT / "recipes" / "qwen_consumer_gpu_calc.yaml"


def calc(*overrides: str):
    return load_recipe(CALC, list(overrides))[0]


def plan(recipe, gib: float | None, device: str = "cuda", strategy: Resolution = AUTO_STRATEGY):
    budget = Budget(None if gib is None else int(gib * GIB), "test")
    return plan_memory(recipe, STUDENT, TEACHER, device, "bfloat16" if device == "cuda" else "float32",
                       "paged_adamw_8bit" if device == "cuda" else "adamw", strategy, budget)


def counted(stage, device: str) -> int:
    return stage.allocated if device == "cuda" else stage.total


@pytest.mark.parametrize("gib", [4.0, 4.5, 6.0, 8.0, 24.0])
def test_every_stage_fits_the_budget_and_each_auto_size_is_the_largest_that_does(gib: float):
    recipe = calc()
    got = plan(recipe, gib)
    assert all(counted(s, "cuda") <= gib * GIB for s in got.stages)
    cap = recipe.train.rollouts_per_cycle
    for name, stage in (("generation", "rollout"), ("micro", "gradient"), ("score", "teacher_score")):
        size = getattr(got.sizes, name)
        if size == cap:
            continue
        bigger = Sizes(**{**got.sizes.__dict__, name: size + 1})
        stages = {s.stage: s for s in estimate(recipe, STUDENT, TEACHER, "cuda", "bfloat16", "paged_adamw_8bit",
                                               got.strategy, bigger)}
        assert counted(stages[stage], "cuda") > gib * GIB, (name, size)


def test_a_larger_budget_never_plans_smaller_batches():
    for gib in (4.0, 5.0, 6.0, 8.0, 16.0):  # the auto strategy never chooses smaller batches than resident has
        auto, resident = plan(calc(), gib), plan(calc("memory.strategy=resident"), gib)
        assert (auto.sizes.generation, auto.sizes.micro) >= (resident.sizes.generation, resident.sizes.micro)
    resident = [plan(calc("memory.strategy=resident"), gib, strategy=Resolution("resident", "r")).sizes
                for gib in (4.0, 5.0, 8.0)]
    for small, large in zip(resident, resident[1:]):
        assert (large.generation, large.micro, large.score) >= (small.generation, small.micro, small.score)


def test_four_gib_parks_the_teacher_and_eight_keeps_it():
    """At 4 GiB the teacher's 3.2 GiB leave resident room for one trajectory; parked, the student's stages fill up."""
    four, eight = plan(calc(), 4.0), plan(calc(), 8.0)
    resident_four = plan(calc("memory.strategy=resident"), 4.0, strategy=Resolution("resident", "requested"))
    assert four.strategy == "swap" and "pinned host memory" in four.resolutions["memory.strategy"].reason
    assert four.sizes.generation > resident_four.sizes.generation and four.sizes.micro > resident_four.sizes.micro
    assert eight.strategy == "resident" and eight.sizes == Sizes(8, 8, 8)
    assert "no larger batch" in eight.resolutions["memory.strategy"].reason


def test_the_resolutions_name_every_planned_key_and_the_applied_recipe_runs_numbers():
    recipe = calc()
    got = plan(recipe, 4.0)
    assert set(got.resolutions) == set(PLANNED_KEYS)
    assert got.resolutions["memory.budget"].value == "4.000 GiB"
    for key in ("rollout.generation_batch_size", "train.trajectory_batch_size", "train.score_batch_size"):
        assert got.resolutions[key].reason.startswith("auto: the ") and "GiB" in got.resolutions[key].reason
    applied = got.applied(recipe)
    assert applied.rollout.generation_batch_size == got.sizes.generation
    assert applied.train.trajectory_batch_size == got.sizes.micro
    assert applied.train.score_batch_size == got.sizes.score
    # Nothing else changes: the objective's keys are the recipe's own.
    assert msgspec.structs.replace(applied, train=recipe.train, rollout=recipe.rollout) == recipe


def test_an_explicit_strategy_and_fixed_sizes_are_kept():
    recipe = calc("train.trajectory_batch_size=2", "rollout.generation_batch_size=3", "memory.strategy=resident")
    got = plan(recipe, 8.0, strategy=Resolution("resident", "requested by the recipe"))
    assert got.strategy == "resident" and got.sizes == Sizes(3, 2, 2)
    assert got.resolutions["train.score_batch_size"].reason.startswith("train.trajectory_batch_size's value")
    assert got.resolutions["rollout.generation_batch_size"].reason.startswith("requested by the recipe")


def test_a_fixed_size_above_an_explicit_budget_is_refused_by_name():
    recipe = calc("train.trajectory_batch_size=8", "memory.strategy=resident", "memory.budget=4")
    with pytest.raises(RecipeError, match=r"^recipe key train.trajectory_batch_size: the gradient stage would need "
                                          r"about [\d.]+ GiB at 8 and memory.budget is 4.00 GiB; lower"):
        plan(recipe, 4.0, strategy=Resolution("resident", "requested by the recipe"))


def test_an_auto_size_that_fits_nowhere_is_one_with_the_reason_said():
    got = plan(calc("rollout.max_total_tokens=60000", "rollout.max_new_tokens_per_turn=512"), 4.0)
    assert got.sizes.micro == 1
    assert "even 1 needs about" in got.resolutions["train.trajectory_batch_size"].reason


def test_a_budget_below_the_weights_is_refused():
    with pytest.raises(RecipeError, match="^memory.budget: 2.00 GiB cannot hold the preflight stage"):
        plan(calc("memory.budget=2"), 2.0)


def test_auto_budget_is_free_memory_less_a_margin_and_unknown_memory_plans_one_at_a_time():
    recipe = calc()
    budget = budget_of(recipe, 10 * GIB, "CUDA free memory")
    assert budget.bytes == 9 * GIB and "less a margin of 1.00 GiB" in budget.reason
    assert budget_of(recipe, GIB, "x").bytes == GIB - 256 * 2**20  # the margin's floor
    unknown = plan(recipe, None)
    assert unknown.sizes == Sizes(1, 1, 1)
    assert unknown.resolutions["memory.budget"].value == "none"
    assert budget_of(calc("memory.budget=6.5"), None, "x") == Budget(int(6.5 * GIB), "requested by the recipe")


def test_cpu_plans_against_the_whole_process_and_never_swaps():
    recipe = calc("models.student.quantization=none")
    got = plan(recipe, 20.0, device="cpu", strategy=Resolution("resident", "cpu"))
    assert got.strategy == "resident" and got.sizes.micro > 1
    assert all(s.total <= 20 * GIB for s in got.stages)


def test_a_resumed_run_keeps_its_recorded_plan():
    recipe = calc()
    fresh = plan(recipe, 8.0)
    recorded = {"memory.strategy": {"value": "swap", "reason": "recorded"},
                "rollout.generation_batch_size": {"value": "3", "reason": "recorded"},
                "train.trajectory_batch_size": {"value": "2", "reason": "recorded"},
                "train.score_batch_size": {"value": "1", "reason": "recorded"},
                "memory.budget": {"value": "4.000 GiB", "reason": "recorded"}}
    kept = recorded_plan(recipe, recorded, fresh)
    assert kept.strategy == "swap" and kept.sizes == Sizes(3, 2, 1)
    assert kept.applied(recipe).train.trajectory_batch_size == 2
    assert kept.resolutions["memory.budget"].value == "4.000 GiB"


def test_a_run_from_before_the_plan_resumes_with_its_recipes_numbers():
    recipe = calc("train.trajectory_batch_size=1", "rollout.generation_batch_size=1")
    fresh = plan(recipe, 8.0)
    kept = recorded_plan(recipe, {"memory.strategy": {"value": "resident", "reason": "old"}}, fresh)
    assert kept.strategy == "resident" and (kept.sizes.generation, kept.sizes.micro) == (1, 1)


def test_prepare_uses_the_recorded_plan(tmp_path: Path):
    """`run.commands.prepare` with a run's resolved.json entries: the plan in them, whatever is free now."""
    from miniverl.engine.run.commands import prepare

    recipe = load_recipe(ROOT / "recipes" / "tiny_calc.yaml", ["train.trajectory_batch_size=auto",
                                                                "rollout.generation_batch_size=auto"])[0]
    fresh = prepare(recipe)
    assert fresh.plan.sizes.micro == recipe.train.rollouts_per_cycle  # tiny models: everything fits
    recorded = {"train.trajectory_batch_size": {"value": "3", "reason": "r"},
                "rollout.generation_batch_size": {"value": "5", "reason": "r"},
                "train.score_batch_size": {"value": "2", "reason": "r"},
                "memory.strategy": {"value": "resident", "reason": "r"}}
    host = prepare(recipe, recorded)
    assert host.plan.sizes == Sizes(5, 3, 2)
    assert host.plan.applied(recipe).rollout.generation_batch_size == 5


def test_the_dense_copy_is_planned_where_it_fits_beside_the_batch_and_counted_in_the_rollout_stage():
    """4 GiB, teacher parked: 8 sequences and the bf16 copy of the NF4 linears (~0.82 GiB) both fit."""
    four = plan(calc(), 4.0)
    assert four.dense_copy and four.resolutions["rollout.dense_copy"].value == "true"
    reason = four.resolutions["rollout.dense_copy"].reason
    assert reason.startswith("auto: the copy (0.8") and "8 sequences" in reason
    without = {s.stage: s for s in estimate(calc(), STUDENT, TEACHER, "cuda", "bfloat16", "paged_adamw_8bit",
                                            four.strategy, four.sizes)}
    planned = {s.stage: s for s in four.stages}
    copy = planned["rollout"].weights - without["rollout"].weights
    assert 0.80 * GIB < copy < 0.85 * GIB  # 28 layers x 15.7 M linear weights in bf16
    assert counted(planned["rollout"], "cuda") <= 4.0 * GIB
    assert {k: v for k, v in planned.items() if k != "rollout"} == {k: v for k, v in without.items() if k != "rollout"}
    assert four.applied(calc()).rollout.dense_copy is True


def test_no_dense_copy_for_a_bf16_student_the_plain_engine_or_a_budget_it_does_not_fit():
    # one sequence at a time takes the copy too where it fits (faster than the NF4 kernels since session 15)
    one = plan(calc("rollout.generation_batch_size=1"), 4.0)
    assert one.dense_copy and "one sequence decodes faster" in one.resolutions["rollout.dense_copy"].reason
    for overrides in (["models.student.quantization=none"], ["rollout.engine=plain"]):
        got = plan(calc(*overrides), 8.0)
        assert not got.dense_copy and got.resolutions["rollout.dense_copy"].reason.startswith("not applicable")
    assert not plan(calc(), 8.0, device="cpu").dense_copy
    # 8 sequences fixed, resident teacher: the batch fits 4.2 GiB, the copy beside it does not.
    tight = plan(calc("rollout.generation_batch_size=8", "memory.strategy=resident"), 5.0,
                 strategy=Resolution("resident", "requested"))
    assert not tight.dense_copy and tight.resolutions["rollout.dense_copy"].reason.endswith("above it")
    assert not plan(calc("rollout.dense_copy=false"), 8.0).dense_copy
    # Asked for: counted in every rollout size tried; refused where even one sequence and the copy do not fit.
    asked = plan(calc("rollout.dense_copy=true", "memory.budget=5"), 5.0)
    assert asked.dense_copy and asked.resolutions["rollout.dense_copy"].reason.startswith("requested by the recipe")
    with pytest.raises(RecipeError, match="rollout.dense_copy: the copy"):
        plan(calc("rollout.dense_copy=true", "memory.strategy=resident", "memory.budget=4.2"), 4.2,
             strategy=Resolution("resident", "requested"))


def test_a_recorded_plan_keeps_its_dense_copy_and_an_older_run_decodes_without_one():
    fresh = plan(calc(), 4.0)
    recorded = {key: {"value": r.value, "reason": r.reason} for key, r in fresh.resolutions.items()}
    assert recorded_plan(calc(), recorded, fresh).dense_copy
    older = {k: v for k, v in recorded.items() if k != "rollout.dense_copy"}
    again = recorded_plan(calc(), older, fresh)
    assert not again.dense_copy and again.applied(calc()).rollout.dense_copy is False
