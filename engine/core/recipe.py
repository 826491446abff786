"""Recipes: flat YAML decoded into strict msgspec Structs.

An unknown key, a wrong type or an out-of-range value is one `RecipeError`
line naming the key path (`models.student.lora.r`) and what was expected,
found by validating the YAML data against the JSON Schema of `Recipe` before
msgspec decodes it (engine.core.schema_check).
`auto` values stay `auto` here; preflight resolves them and records why.
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Sequence

import msgspec
import yaml

from miniverl.engine.core import schema_check
from miniverl.engine.core.errors import RecipeError
from miniverl.engine.core.schema_check import KeyPath, Problem

if TYPE_CHECKING:
    from jsonschema.protocols import Validator

Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Probability = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0.0)]

BUILTIN_PREFIX = "miniverl-builtin/"


def _upto(limit: int, why: str) -> Any:
    """A positive count with a documented ceiling; the schema error quotes `why` when a recipe passes it."""
    return Annotated[int, msgspec.Meta(ge=1, le=limit, description=why)]


# Ceilings on counts that have no sane use beyond them (README, "Recipe limits"): each would only make a
# run hang, exhaust memory or fill the disk long before it taught anything.
MAX_CYCLES = 100_000  # cycle ids are six digits; a real OPD run takes hundreds to thousands of steps
MAX_BATCH = 4096  # sequences on one card at a time; far above what 24 GiB holds at any useful length
MAX_TOKENS = 1_048_576  # a million-token budget; the models' own context length is checked against it too
MAX_TURNS = 64
MAX_RANK = 1024  # a LoRA rank at a 1024-wide model is already a full-rank update
MAX_TOPK = 4096
MAX_HELDOUT = 100_000
Cycles = _upto(MAX_CYCLES, f"{MAX_CYCLES:,} optimizer steps is far beyond any OPD run")
BatchCount = _upto(MAX_BATCH, f"more than {MAX_BATCH} sequences at a time cannot fit one card")
RolloutCount = _upto(MAX_BATCH, f"more than {MAX_BATCH} trajectories a cycle cannot fit one card")
TokenCount = _upto(MAX_TOKENS, f"more than {MAX_TOKENS:,} tokens a sequence cannot be trained on one card")
TurnCount = _upto(MAX_TURNS, f"{MAX_TURNS} turns is beyond any tool-use episode worth training")
Rank = _upto(MAX_RANK, f"beyond rank {MAX_RANK} an adapter is no longer low-rank")
TopK = _upto(MAX_TOPK, f"for more than {MAX_TOPK} teacher tokens use loss.mode: exact")
ChunkSize = _upto(MAX_TOKENS, f"a chunk is at most the {MAX_TOKENS:,}-token sequence ceiling")
HeldoutCount = _upto(MAX_HELDOUT, f"{MAX_HELDOUT:,} held-out items is more than a verify needs")
MAX_BUDGET_GIB = 16_384.0  # 16 TiB: a budget past any card's memory is a typo
Auto = Literal["auto"]  # resolved by the memory plan at preflight (engine.models.memory_plan)
BudgetGiB = Annotated[float, msgspec.Meta(gt=0.0, le=MAX_BUDGET_GIB, description="GiB of device memory for the run")]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


class LoraSpec(_Strict):
    r: Rank = 8
    alpha: PositiveFloat = 16.0
    dropout: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.0
    target_modules: list[str] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


class TeacherAdapterSpec(_Strict):
    """A frozen teacher adapter for shared_backbone, with the base it was trained on."""

    path: str
    base_id: str
    base_revision: str | None = None
    sha256: str | None = None


class StudentSpec(_Strict):
    id: str
    revision: str | None = None
    path: str | None = None
    quantization: Literal["nf4", "none"] = "none"
    lora: LoraSpec = msgspec.field(default_factory=LoraSpec)


class TeacherSpec(_Strict):
    id: str
    revision: str | None = None
    path: str | None = None
    adapter: TeacherAdapterSpec | None = None


class ModelsSpec(_Strict, kw_only=True):
    runtime: Literal["dual_model", "shared_backbone"] = "dual_model"
    device: Literal["auto", "cuda", "cpu"] = "auto"
    student: StudentSpec
    teacher: TeacherSpec


class OptimizerSpec(_Strict):
    name: Literal["auto", "adamw", "paged_adamw_8bit"] = "auto"
    lr: PositiveFloat = 1e-3
    beta1: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.9
    beta2: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.999
    eps: PositiveFloat = 1e-8
    weight_decay: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    grad_clip: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0


class TrainSpec(_Strict):
    cycles: Cycles = 10
    rollouts_per_cycle: RolloutCount = 32
    # Trajectories per gradient micro-batch; `auto`: the largest the memory plan fits in memory.budget.
    trajectory_batch_size: BatchCount | Auto = 1
    # Trajectories per teacher-score forward; unset: trajectory_batch_size's value (the plan sizes it
    # on its own when trajectory_batch_size is auto, the teacher's activations being another size).
    score_batch_size: BatchCount | Auto | None = None
    # Recompute each student layer in the gradient stage's backward instead of
    # keeping its activations: less memory, one more forward; same gradient.
    gradient_checkpointing: bool = False
    # With gradient_checkpointing: the one tensor each layer keeps (its input) waits in pinned host memory
    # until that layer's backward, so the kept inputs take no device memory; same gradient, bit for bit.
    # auto: on CUDA with checkpointing.
    offload_activations: bool | Auto = "auto"
    # liger-kernel's fused RMSNorm and SiLU-mul in the student's layers for the gradient stage (less memory
    # per recomputed layer, fewer launches). auto: on CUDA where liger-kernel is installed.
    fused_kernels: bool | Auto = "auto"

    @property
    def score_batch(self) -> int | str:
        """The teacher-score micro-batch: score_batch_size, else trajectory_batch_size's value."""
        return self.trajectory_batch_size if self.score_batch_size is None else self.score_batch_size


class RolloutSpec(_Strict):
    max_turns: TurnCount = 3
    max_new_tokens_per_turn: TokenCount = 64
    max_total_tokens: TokenCount = 512
    temperature: PositiveFloat = 1.0
    top_p: Probability = 1.0
    generation_batch_size: BatchCount | Auto = 32
    # auto: the CUDA-graph decode engine on CUDA (its step through the Triton decode kernels where those are
    # faster), the plain forward-pass loop elsewhere; graph: that engine with its module-by-module step only;
    # plain: the loop everywhere (slower; for debugging and for the before/after benchmark).
    engine: Literal["auto", "graph", "plain"] = "auto"
    # An NF4 student's base weights dequantized once per rollout stage into one copy in the compute dtype, so
    # several sequences decode through plain matmuls on the very weights bitsandbytes' matmul dequantizes to.
    # auto: where the memory plan fits the copy beside the rollout's batch (faster from one sequence on);
    # freed when the stage ends.
    dense_copy: bool | Auto = "auto"


class LossRecipe(_Strict):
    mode: Literal["sampled_kl", "topk_tail", "exact"] = "exact"
    divergence: Literal["reverse_kl", "forward_kl", "jsd"] = "reverse_kl"
    jsd_beta: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 0.5
    topk: TopK = 16
    chunk_size: ChunkSize = 256


class MemorySpec(_Strict):
    # resident: both models stay on the device; swap: an idle unquantized model's weights wait in pinned
    # host memory (the teacher's head stays for exact mode's gradient stage); auto: swap only where the
    # memory plan fits larger batches with it.
    strategy: Literal["auto", "resident", "swap"] = "auto"
    # Device memory the run may allocate, in GiB; auto: what is free when the run plans, less a margin.
    budget: BudgetGiB | Auto = "auto"
    min_chunk_size: ChunkSize = 16


# A built-in task, `jsonl` (the user's own file), or a Python class as `package.module:Class` / `file.py:Class`.
TaskName = Annotated[str, msgspec.Meta(pattern=r"^(calculator|sql|jsonl|[A-Za-z0-9_./-]+:[A-Za-z_][A-Za-z0-9_]*)$")]


class TaskSpec(_Strict):
    """Which skill is taught; the keys below `heldout_seed` belong to one kind of task (tasks.registry checks which)."""

    name: TaskName = "calculator"
    heldout_size: HeldoutCount = 64
    train_seed: NonNegative = 0
    heldout_seed: NonNegative = 0
    operand_max: Annotated[int, msgspec.Meta(ge=10, le=10**6)] | None = None  # calculator (default 999)
    path: str | None = None  # jsonl: the items file, relative to the recipe
    judge: str | None = None  # jsonl: exact | numeric | regex:PATTERN (default exact)
    tools: str | None = None  # jsonl: a Python file of tool functions, relative to the recipe
    options: dict[str, Any] | None = None  # module:Class: keyword arguments of the class


class VerifySpec(_Strict):
    max_new_tokens_per_turn: TokenCount = 64
    batch_size: BatchCount = 64
    min_tool_call_rate: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.5


class WandbSpec(_Strict):
    """Weights & Biases logging of the per-cycle scalars (needs the `wandb` package)."""

    project: str
    entity: str | None = None
    mode: Literal["online", "offline"] | None = None  # None: wandb's own setting (WANDB_MODE, or online)


class ReportSpec(_Strict):
    """Where a run's figures go besides metrics.jsonl and `miniverl report`'s page (nothing here changes training)."""

    tensorboard: bool = False  # TensorBoard scalars as each cycle ends (needs the `tensorboard` package)
    wandb: WandbSpec | None = None


class CheckpointsSpec(_Strict):
    """Which policy checkpoints (adapter + optimizer state) stay on disk; the latest always does."""

    keep_last: Annotated[int, msgspec.Meta(ge=1, le=MAX_CYCLES)] = 2
    keep_every: Annotated[int, msgspec.Meta(ge=0, le=MAX_CYCLES)] = 0  # also every K-th step (0: none)


class ArtifactsSpec(_Strict):
    """Which cycles keep their rollout, teacher scores and gradient once the next checkpoint is durable."""

    keep: Literal["last", "none", "all"] = "last"


class Recipe(_Strict, kw_only=True):
    name: str
    seed: NonNegative = 0
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    models: ModelsSpec
    optimizer: OptimizerSpec = msgspec.field(default_factory=OptimizerSpec)
    train: TrainSpec = msgspec.field(default_factory=TrainSpec)
    rollout: RolloutSpec = msgspec.field(default_factory=RolloutSpec)
    loss: LossRecipe = msgspec.field(default_factory=LossRecipe)
    memory: MemorySpec = msgspec.field(default_factory=MemorySpec)
    task: TaskSpec = msgspec.field(default_factory=TaskSpec)
    verify: VerifySpec = msgspec.field(default_factory=VerifySpec)
    report: ReportSpec = msgspec.field(default_factory=ReportSpec)
    checkpoints: CheckpointsSpec = msgspec.field(default_factory=CheckpointsSpec)
    artifacts: ArtifactsSpec = msgspec.field(default_factory=ArtifactsSpec)


# ---------------------------------------------------------------- schema errors
@functools.cache
def _validator() -> Validator:
    """The JSON Schema msgspec derives from `Recipe`, so the Structs above stay the one definition of a key."""
    return schema_check.strict_validator(msgspec.json.schema(Recipe), source="the Recipe schema")


def dotted(path: KeyPath) -> str:
    """`('rollout', 'stop', 1)` -> `rollout.stop.1`, the way recipes name keys."""
    return ".".join(map(str, path)) or "(top level)"


def schema_problems(data: dict) -> list[Problem]:
    """Every unknown key, missing key, wrong type and out-of-range value of the recipe data at once."""
    return schema_check.problems(_validator(), data)


def problem_line(problem: Problem) -> str:
    """One line naming the key and what it needs: `recipe key train.cycles: expected integer >= 1; got integer 0`."""
    what = {
        "unknown": "unknown key (README.md lists the recipe keys)",
        "missing": "missing required key; add it (README.md lists the recipe keys)",
    }.get(problem.kind, problem.detail)
    return f"recipe key {dotted(problem.path)}: {what}"


def decode_recipe(data: dict, source: str = "recipe") -> Recipe:
    """The Recipe of data that passed `schema_problems`."""
    try:
        return msgspec.convert(data, Recipe, strict=True)
    except msgspec.ValidationError as exc:  # only what a JSON Schema cannot state; msgspec names the key itself
        raise RecipeError(f"{source}: {exc}") from None


def consistency_problems(recipe: Recipe) -> list[str]:
    """Rules that span several keys, one 'recipe key ...' line per broken rule."""
    problems = []
    if recipe.memory.min_chunk_size > recipe.loss.chunk_size:
        problems.append(
            f"recipe key memory.min_chunk_size: {recipe.memory.min_chunk_size} is above loss.chunk_size "
            f"{recipe.loss.chunk_size}; set it to at most the chunk size"
        )
    if recipe.rollout.max_new_tokens_per_turn > recipe.rollout.max_total_tokens:
        problems.append("recipe key rollout.max_new_tokens_per_turn: exceeds rollout.max_total_tokens")
    runtime = recipe.models.runtime
    if runtime == "shared_backbone":
        student, teacher = recipe.models.student, recipe.models.teacher
        if (student.id, student.revision) != (teacher.id, teacher.revision):
            problems.append(
                "recipe key models.runtime: shared_backbone needs student and teacher to name the same base "
                f"(got {student.id}@{student.revision} and {teacher.id}@{teacher.revision}); use dual_model"
            )
        if teacher.adapter is None:
            problems.append("recipe key models.teacher.adapter: shared_backbone needs a frozen teacher adapter")
    if recipe.loss.mode == "topk_tail" and recipe.loss.topk < 2:
        problems.append("recipe key loss.topk: topk_tail needs at least 2 teacher tokens")
    return problems


def _check_consistency(recipe: Recipe) -> None:
    problems = consistency_problems(recipe)
    if problems:
        raise RecipeError(problems[0])


class _RecipeLoader(yaml.SafeLoader):
    """YAML 1.1 reads `3e-3` as a string; recipes mean the number (as YAML 1.2 does)."""


_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_recipe_data(text: str, source: str = "recipe") -> dict:
    """The recipe's YAML as plain data, before any schema check."""
    try:
        data = yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass: no Python objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise RecipeError(f"{source}: not valid YAML{where}; fix the syntax") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: a recipe is a YAML mapping of keys (name, models, train, ...)")
    return data


def parse_recipe(text: str, source: str = "recipe") -> Recipe:
    data = load_recipe_data(text, source)
    found = schema_problems(data)
    if found:  # the first; `miniverl validate` lists them all
        raise RecipeError(problem_line(found[0]))
    recipe = decode_recipe(data, source)
    _check_consistency(recipe)
    return recipe


def _override_value(item: str) -> tuple[list[str], Any]:
    """`train.cycles=80` -> (['train', 'cycles'], 80): the value typed as YAML types it."""
    key, sep, raw = item.partition("=")
    keys = key.strip().split(".")
    if not sep or not all(keys):
        raise RecipeError(f"override {item!r}: expected KEY=VALUE with a dotted recipe key, e.g. train.cycles=80")
    try:
        value = yaml.load(raw, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass: no Python objects
    except yaml.YAMLError:
        raise RecipeError(f"override {key}: {raw!r} is not a YAML value; quote strings that hold ':' or '#'") from None
    return keys, value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """A copy of the recipe data with each `dotted.key=value` set (missing mappings are created)."""
    data = copy.deepcopy(data)
    for item in overrides:
        keys, value = _override_value(item)
        node = data
        for depth, key in enumerate(keys[:-1]):
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override {'.'.join(keys)}: recipe key {'.'.join(keys[:depth + 1])} is not a "
                                  f"mapping, so it has no key {keys[depth + 1]}")
        node[keys[-1]] = value
    return data


def text_with_overrides(text: str, overrides: Sequence[str], source: str = "recipe") -> str:
    """The recipe a run keeps: the text verbatim, or with overrides, the data they give written out as YAML."""
    if not overrides:
        return text
    data = apply_overrides(load_recipe_data(text, source), overrides)
    header = f"# {source} with command-line overrides: {' '.join(overrides)}\n"
    return header + yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def read_recipe_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"recipe file {path} does not exist; pass the path of a YAML recipe") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"recipe file {path} cannot be read: {exc}") from None


def load_recipe(path: Path, overrides: Sequence[str] = ()) -> tuple[Recipe, str]:
    """The decoded recipe and its text (kept in the run: verbatim, or with the overrides applied)."""
    text = text_with_overrides(read_recipe_text(path), overrides, str(path))
    return parse_recipe(text, source=str(path)), text


def recipe_to_builtins(recipe: Recipe) -> dict:
    return msgspec.to_builtins(recipe)
