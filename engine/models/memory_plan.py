"""The memory plan: batch sizes and the memory strategy chosen from a budget, once, at the start of a run.

`memory.budget` is the device memory the run's tensors may take (GiB, or `auto`:
what is free when the run starts, less a margin). Every `auto` batch size
becomes the largest count whose stage fits the budget by the analytic
estimate (`memory_estimate.estimate`), up to `train.rollouts_per_cycle`:

    rollout.generation_batch_size   the rollout stage (KV caches, sampling)
    train.trajectory_batch_size     the gradient stage (activations, loss chunk)
    train.score_batch_size          the teacher-score stage (the teacher's forward)

`memory.strategy: auto` takes `swap` (the teacher's weights in pinned host memory
while the student samples and trains) only where that fits larger batches than
`resident`. The plan is recorded in resolved.json and the manifest with a reason
per key, and a resumed run reads it back rather than planning again, so a run
keeps its batch sizes whatever is free later. Batch sizes change how the work
is cut, never the objective (stages.gradient sums micro-batches exactly).
"""

from __future__ import annotations

from dataclasses import dataclass, replace as replace_dataclass
from typing import Any

import msgspec

from miniverl.engine.core import layout
from miniverl.engine.core.artifacts import Resolution
from miniverl.engine.core.errors import RecipeError
from miniverl.engine.core.recipe import Recipe
from miniverl.engine.models.memory_estimate import (ModelShape, Sizes, StageEstimate, dense_copy_applies, estimate,
                                                   model_shape)

GIB = 2**30
MIN_MARGIN = 256 * 2**20
MARGIN_FRACTION = 0.10  # of the free memory an `auto` budget starts from: allocator rounding, other processes
PLANNED_KEYS = ("memory.budget", "memory.strategy", "rollout.generation_batch_size", "train.trajectory_batch_size",
                "train.score_batch_size", "rollout.dense_copy")
_STAGE_OF = {"generation": layout.ROLLOUT, "micro": layout.GRADIENT, "score": layout.TEACHER_SCORE}
_KEY_OF = {"generation": "rollout.generation_batch_size", "micro": "train.trajectory_batch_size",
           "score": "train.score_batch_size"}


@dataclass(frozen=True)
class Budget:
    bytes: int | None  # None: no figure for this device's free memory
    reason: str


@dataclass(frozen=True)
class MemoryPlan:
    budget: Budget
    strategy: str
    sizes: Sizes
    resolutions: dict[str, Resolution]  # every key in PLANNED_KEYS: its value here and why
    stages: list[StageEstimate]  # the estimate at the planned sizes (empty for a plan read back from a run)
    dense_copy: bool = False  # rollout.dense_copy as planned

    def applied(self, recipe: Recipe) -> Recipe:
        """The recipe the stages run: every planned batch size a number, rollout.dense_copy a bool."""
        s = self.sizes
        return msgspec.structs.replace(
            recipe,
            train=msgspec.structs.replace(recipe.train, trajectory_batch_size=s.micro, score_batch_size=s.score),
            rollout=msgspec.structs.replace(recipe.rollout, generation_batch_size=s.generation,
                                            dense_copy=self.dense_copy),
        )


def budget_of(recipe: Recipe, free_bytes: int | None, free_source: str) -> Budget:
    requested = recipe.memory.budget
    if requested != "auto":
        return Budget(int(requested * GIB), "requested by the recipe")
    if free_bytes is None:
        return Budget(None, f"auto: {free_source} is unknown here, so nothing is sized from it")
    margin = max(MIN_MARGIN, int(free_bytes * MARGIN_FRACTION))
    return Budget(max(free_bytes - margin, 0), f"auto: {free_source} {free_bytes / GIB:.2f} GiB "
                                                f"less a margin of {margin / GIB:.2f} GiB")


def _requested(recipe: Recipe) -> dict[str, int | str]:
    # score follows trajectory_batch_size when unset: sized on its own when that is auto
    return {"generation": recipe.rollout.generation_batch_size, "micro": recipe.train.trajectory_batch_size,
            "score": recipe.train.score_batch}


def one_at_a_time(recipe: Recipe) -> Sizes:
    """The recipe's sizes with every `auto` as 1."""
    return Sizes(**{name: (value if value != "auto" else 1) for name, value in _requested(recipe).items()})


def _by_stage(stages: list[StageEstimate]) -> dict[str, StageEstimate]:
    return {s.stage: s for s in stages}


def _counted(stage: StageEstimate, device: str) -> int:
    """What the budget limits: allocated tensor bytes on CUDA, the whole process (resident set) on the CPU."""
    return stage.allocated if device == "cuda" else stage.total


def _fit(recipe: Recipe, student: ModelShape, teacher: ModelShape, device: str, dtype: str, optimizer: str,
         strategy: str, budget: int | None) -> tuple[Sizes, dict[str, bool]]:
    """The sizes under one strategy: each auto one the largest that fits (1 when none does); whether each fits."""
    cap = recipe.train.rollouts_per_cycle
    requested = _requested(recipe)
    chosen = {name: (value if value != "auto" else 1) for name, value in requested.items()}

    def stage_bytes(name: str, n: int) -> int:
        sizes = Sizes(**{**chosen, name: n})
        return _counted(_by_stage(estimate(recipe, student, teacher, device, dtype, optimizer, strategy, sizes))
                        [_STAGE_OF[name]], device)

    fits: dict[str, bool] = {}
    for name, value in requested.items():
        if value != "auto":
            fits[name] = budget is None or stage_bytes(name, value) <= budget
            continue
        if budget is None:
            chosen[name], fits[name] = 1, True
            continue
        lo, hi = 1, cap  # the estimate grows with n: the largest n in [1, cap] that fits
        if stage_bytes(name, 1) > budget:
            chosen[name], fits[name] = 1, False
            continue
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if stage_bytes(name, mid) <= budget else (lo, mid - 1)
        chosen[name], fits[name] = lo, True
    return Sizes(**chosen), fits


def plan_memory(recipe: Recipe, student: ModelShape, teacher: ModelShape, device: str, dtype: str, optimizer: str,
                strategy: Resolution, budget: Budget) -> MemoryPlan:
    """Choose the sizes and the strategy; refuses (RecipeError) what an explicit budget cannot hold."""
    can_swap = device == "cuda" and recipe.models.runtime == "dual_model"
    if recipe.memory.strategy == "auto" and can_swap:
        candidates = ["resident", "swap"]
    else:
        candidates = [strategy.value]
    fitted = {name: _fit(recipe, student, teacher, device, dtype, optimizer, name, budget.bytes) for name in candidates}
    chosen = candidates[0]
    strategy_reason = strategy.reason
    if len(candidates) == 2:
        (resident, resident_fits), (swap, swap_fits) = fitted["resident"], fitted["swap"]
        bigger = [name for name in _KEY_OF if getattr(swap, name) > getattr(resident, name)]
        fitting = sum(swap_fits.values()) - sum(resident_fits.values())
        if fitting > 0 or (fitting == 0 and bigger):
            chosen = "swap"
            gains = ", ".join(f"{_KEY_OF[n]} {getattr(swap, n)} (resident: {getattr(resident, n)})" for n in bigger)
            strategy_reason = ("auto: the teacher waits in pinned host memory while the student samples and trains, "
                               + (f"which fits {gains} in the budget" if gains else "without which a stage does "
                                  "not fit the budget"))
        else:
            strategy_reason = "auto: resident; parking the teacher in host memory would fit no larger batch"
    sizes, fits = fitted[chosen]
    stages = estimate(recipe, student, teacher, device, dtype, optimizer, chosen, sizes)
    by_stage = _by_stage(stages)
    requested = _requested(recipe)
    explicit = recipe.memory.budget != "auto"
    budget_gib = "unknown" if budget.bytes is None else f"{budget.bytes / GIB:.2f} GiB"
    resolutions = {
        "memory.budget": Resolution("none" if budget.bytes is None else f"{budget.bytes / GIB:.3f} GiB",
                                     budget.reason),
        "memory.strategy": Resolution(chosen, strategy_reason),
    }
    for name, key in _KEY_OF.items():
        value = getattr(sizes, name)
        need = _counted(by_stage[_STAGE_OF[name]], device) / GIB
        if requested[name] != "auto":
            origin = "requested by the recipe" if name != "score" or recipe.train.score_batch_size is not None \
                else "train.trajectory_batch_size's value"
            if not fits[name] and explicit:
                raise RecipeError(f"recipe key {key}: the {_STAGE_OF[name]} stage would need about {need:.2f} GiB "
                                  f"at {value} and memory.budget is {budget_gib}; lower {key} or set it to auto")
            reason = f"{origin}; the {_STAGE_OF[name]} stage needs about {need:.2f} GiB of the {budget_gib} budget"
        elif budget.bytes is None:
            reason = "auto: no memory figure here, so one at a time"
        elif not fits[name]:
            # Not refused: the estimate errs high, and a real out-of-memory error halves loss.chunk_size.
            reason = (f"auto: 1, though by the estimate even 1 needs about {need:.2f} GiB, above the {budget_gib} "
                      f"budget; a lower loss.chunk_size or rollout.max_total_tokens would fit it")
        else:
            limit = "train.rollouts_per_cycle" if value == recipe.train.rollouts_per_cycle else "the budget"
            reason = f"auto: the {_STAGE_OF[name]} stage needs about {need:.2f} GiB of the {budget_gib} budget " \
                     f"(the largest that {limit} allows)"
        resolutions[key] = Resolution(str(value), reason)
    resolutions["rollout.dense_copy"] = _plan_dense_copy(recipe, student, teacher, device, dtype, optimizer, chosen,
                                                         sizes, budget)
    dense_copy = resolutions["rollout.dense_copy"].value == "true"
    if dense_copy:
        stages = estimate(_with_dense_copy(recipe, True), student, teacher, device, dtype, optimizer, chosen, sizes)
    if explicit:
        for stage in stages:  # the stages no batch size is planned for
            if stage.stage not in _STAGE_OF.values() and _counted(stage, device) > budget.bytes:
                raise RecipeError(f"memory.budget: {budget_gib} cannot hold the {stage.stage} stage (about "
                                  f"{_counted(stage, device) / GIB:.2f} GiB); raise it")
    return MemoryPlan(budget, chosen, sizes, resolutions, stages, dense_copy)


def _with_dense_copy(recipe: Recipe, copy: bool) -> Recipe:
    return msgspec.structs.replace(recipe, rollout=msgspec.structs.replace(recipe.rollout, dense_copy=copy))


def _plan_dense_copy(recipe: Recipe, student: ModelShape, teacher: ModelShape, device: str, dtype: str,
                     optimizer: str, strategy: str, sizes: Sizes, budget: Budget) -> Resolution:
    """rollout.dense_copy at the planned sizes: the batch comes first, the copy only where it fits beside it.

    Measured at the Qwen3-0.6B shape (NF4 + LoRA r16, the copy with the adapter merged in; the kernel step,
    results/decode_step_sweep_h200.md, session 15, one H100 run): a step of one sequence takes 0.81 ms on the
    copy against 1.19 through the in-register NF4 kernels, of eight 1.40 against 2.69 (on an H200, session 13:
    0.71 against 1.16 and 1.34 against 3.05). So the copy pays from one sequence on. Building it, once a
    rollout stage, is not timed apart; with it the calc recipe's rollout stage of eight sequences took 1.8-1.9 s
    against 3.3 without (README, rollout.dense_copy)."""
    requested = recipe.rollout.dense_copy
    if not dense_copy_applies(recipe, device):
        return Resolution("false", "not applicable: no NF4 student decoded by the CUDA-graph engine here")
    if requested is False:
        return Resolution("false", "requested by the recipe")

    def rollout_bytes(copy: bool) -> int:
        stages = estimate(_with_dense_copy(recipe, copy), student, teacher, device, dtype, optimizer, strategy, sizes)
        return _counted(_by_stage(stages)[layout.ROLLOUT], device)

    need = rollout_bytes(True)
    copy = need - rollout_bytes(False)
    budget_gib = "unknown" if budget.bytes is None else f"{budget.bytes / GIB:.2f} GiB"
    fits = budget.bytes is None or need <= budget.bytes
    what = f"the copy ({copy / GIB:.2f} GiB) takes the rollout stage to about {need / GIB:.2f} GiB of the " \
           f"{budget_gib} budget"
    if requested is True:
        if not fits and recipe.memory.budget != "auto":
            raise RecipeError(f"recipe key rollout.dense_copy: {what}; set it to auto or false, or lower "
                              "rollout.generation_batch_size")
        return Resolution("true", f"requested by the recipe; {what}")
    sequences = min(sizes.generation, recipe.train.rollouts_per_cycle)
    if budget.bytes is None:
        return Resolution("false", "auto: no memory figure here to fit a copy in")
    if not fits:
        return Resolution("false", f"auto: {what}, above it")
    decode = "one sequence decodes" if sequences == 1 else f"{sequences} sequences decode"
    return Resolution("true", f"auto: {what}; {decode} faster on it than through the NF4 weights")


def recorded_plan(recipe: Recipe, recorded: dict[str, Any], fresh: MemoryPlan) -> MemoryPlan:
    """The plan a run recorded at preflight (resolved.json's `resolved`); keys it lacks (an older run) from `fresh`."""
    values: dict[str, Any] = {}
    resolutions = dict(fresh.resolutions)
    for key in PLANNED_KEYS:
        entry = recorded.get(key)
        if isinstance(entry, dict) and "value" in entry:
            resolutions[key] = Resolution(entry["value"], entry.get("reason", "recorded"))
            values[key] = entry["value"]
    if "train.trajectory_batch_size" not in values:  # a run from before the plan: its recipe's numbers
        requested = _requested(recipe)
        values.update({_KEY_OF[n]: v for n, v in requested.items() if v != "auto"})
    sizes = Sizes(int(values.get("rollout.generation_batch_size", fresh.sizes.generation)),
                  int(values.get("train.trajectory_batch_size", fresh.sizes.micro)),
                  int(values.get("train.score_batch_size", fresh.sizes.score)))
    strategy = str(values.get("memory.strategy", fresh.strategy))
    if "rollout.dense_copy" not in values:  # a run from before the key decodes as it did
        resolutions["rollout.dense_copy"] = Resolution("false", "not recorded by this run's preflight")
    dense_copy = values.get("rollout.dense_copy", "false") == "true"
    return replace_dataclass(fresh, strategy=strategy, sizes=sizes, resolutions=resolutions, stages=[],
                             dense_copy=dense_copy)


def plan_for_configs(recipe: Recipe, configs: dict[str, dict[str, Any] | None], device: str, dtype: str,
                     optimizer: str, strategy: Resolution, free_bytes: int | None, free_source: str) -> MemoryPlan:
    """`plan_memory` for the located models' configs; a config the estimate cannot read plans one at a time."""
    budget = budget_of(recipe, free_bytes, free_source)
    try:
        student, teacher = (model_shape(configs[role] or {}) for role in ("student", "teacher"))
    except (KeyError, TypeError, ValueError):
        requested = _requested(recipe)
        sizes = one_at_a_time(recipe)
        note = "no memory estimate for this architecture"
        resolutions = {"memory.budget": Resolution("none", note), "memory.strategy": strategy,
                       **{key: Resolution(str(getattr(sizes, n)), "requested by the recipe" if requested[n] != "auto"
                                          else f"auto: {note}, so one at a time") for n, key in _KEY_OF.items()},
                       "rollout.dense_copy": Resolution("false", f"{note}, so no copy")}
        return MemoryPlan(budget, strategy.value, sizes, resolutions, [])
    return plan_memory(recipe, student, teacher, device, dtype, optimizer, strategy, budget)
