"""The refusals a run makes about its models before any weight is loaded, in one place.

The real run (`ModelHost`, reached through `engine.run.commands.prepare`) and
`miniverl run --dry-run` both call `check_models`: the run raises the first
refusal, the dry run collects every one and goes on with the checks that do
not depend on it. So a recipe the dry run passes is never refused by the run
for a reason that was visible without loading weights.

The recipe itself (schema, rules spanning keys), the `auto` resolutions and
the model locations are checked before this, by functions the run and
`miniverl validate` (which the dry run starts with) share:
`core.recipe.consistency_problems`, `core.device.resolve_*` and
`models.loading.locate_model`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from miniverl.engine.core.device import package_version
from miniverl.engine.core.errors import IncompatibleModelsError, RecipeError, UserError
from miniverl.engine.core.recipe import Recipe, StudentSpec
from miniverl.engine.models.loading import (
    Pairing, TeacherAdapter, check_pairing, check_teacher_adapter, load_tokenizer, read_config, require_pairing,
)
from miniverl.engine.models.memory_estimate import checkpoint_tensors

ROLES = ("student", "teacher")
T = TypeVar("T")


class Refusals:
    """What a refusal does: the run lets the first one raise; the dry run keeps each message and checks on."""

    def __init__(self, collect: bool):
        self.collect = collect
        self.messages: list[str] = []

    def check(self, check: Callable[..., T], *args: Any) -> T | None:
        """`check(*args)`, or None when it refused and refusals are being collected."""
        try:
            return check(*args)
        except UserError as exc:
            if not self.collect:
                raise
            self.messages.append(str(exc))
            return None


@dataclass(frozen=True)
class CheckedModels:
    """What the checks read, for the host and for the dry run's report; None where a check refused."""

    configs: dict[str, dict[str, Any] | None]  # role -> config.json
    tensors: dict[str, dict[str, int] | None]  # role -> tensor name -> elements, from the safetensors headers
    tokenizer: Any | None  # the student's tokenizer: the run tokenizes with it
    pairing: Pairing | None
    teacher_adapter: TeacherAdapter | None  # shared_backbone's verified frozen adapter


def check_models(recipe: Recipe, dirs: dict[str, Path], refusals: Refusals) -> CheckedModels:
    """Every check of the located models that needs no weights, in the order the run meets them."""
    # One directory serving both roles (shared_backbone) is checked once, as the student.
    roles = ROLES if dirs["student"].resolve() != dirs["teacher"].resolve() else ("student",)
    configs = {role: refusals.check(read_config, dirs[role]) for role in roles}
    for role in roles:
        if configs[role] is not None:
            refusals.check(check_causal_lm, role, configs[role])
    tensors = {role: refusals.check(read_checkpoint, role, dirs[role]) for role in roles}
    for found in (configs, tensors):
        found.setdefault("teacher", found["student"])
    if tensors["student"] is not None and configs["student"] is not None:
        refusals.check(check_lora_targets, recipe.models.student, tensors["student"], configs["student"])
    for role in roles:
        if configs[role] is not None:
            refusals.check(check_context, role, recipe, configs[role])
    adapter = _check_runtime(recipe, dirs, refusals)
    tokenizer = refusals.check(load_student_tokenizer, dirs["student"])
    pairing = None
    if tokenizer is not None and all(_has_rows(config) for config in configs.values()):
        pairing = refusals.check(check_pairing, dirs["student"], dirs["teacher"], len(tokenizer))
    if pairing is not None:
        refusals.check(require_pairing, pairing)
    return CheckedModels(configs, tensors, tokenizer, pairing, adapter)


def check_context(role: str, recipe: Recipe, config: dict[str, Any]) -> None:
    """A sequence longer than the model's positions would be trained on positions it never saw."""
    limit = config.get("text_config", config).get("max_position_embeddings")
    budget = recipe.rollout.max_total_tokens
    if _is_int(limit) and budget > limit:
        raise RecipeError(f"recipe key rollout.max_total_tokens: {budget:,} is beyond the {role}'s context "
                          f"(max_position_embeddings {limit:,}); set it to at most {limit:,}")


def _has_rows(config: dict[str, Any] | None) -> bool:
    """Pairing reads `vocab_size`; without it check_causal_lm has already refused, once is enough."""
    return config is not None and _is_int(config.get("vocab_size"))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_causal_lm(role: str, config: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint must be a decoder with an LM head that transformers' AutoModelForCausalLM can build."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architectures = [str(a) for a in config.get("architectures") or []]
    if not any(a.endswith("ForCausalLM") for a in architectures):
        # e.g. a bare `Qwen3Model`: transformers would load it with a randomly initialised head.
        raise UserError(f"models.{role}: architecture {','.join(architectures) or 'unknown'} is not a causal LM "
                        f"(…ForCausalLM); point models.{role} at a checkpoint with a language-model head")
    model_type = config.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"models.{role}: model_type {model_type!r} has no causal-LM class in transformers "
                        f"{package_version('transformers')}; upgrade transformers or pick a model it supports")
    for key in ("vocab_size", "hidden_size"):  # pairing and preflight's model identity read these
        if not _is_int(config.get(key)):
            raise UserError(f"models.{role}: config.json has no integer {key}; a causal LM's config names it")
    return config


def read_checkpoint(role: str, directory: Path) -> dict[str, int]:
    """Tensor sizes from the safetensors headers; weights in any other format are refused (they unpickle)."""
    from safetensors import SafetensorError

    try:
        tensors = checkpoint_tensors(directory)
    except (SafetensorError, OSError, ValueError, KeyError, TypeError, struct.error) as exc:  # header readers differ
        raise UserError(f"models.{role}: a *.safetensors header in {directory} is unreadable "
                        f"({type(exc).__name__}); download the checkpoint again") from None
    if tensors is None:
        raise UserError(f"models.{role}: no *.safetensors weights in {directory}; miniverl loads safetensors "
                        f"only, so convert the checkpoint or point models.{role} at one that has them")
    return tensors


def check_lora_targets(spec: StudentSpec, tensors: dict[str, int], config: dict[str, Any]) -> list[str]:
    """Each target must name a module of the student, as peft matches it: the full name or its dotted suffix.

    peft refuses only when no target matches; a typo beside valid names would
    silently train fewer modules than the recipe says.
    """
    modules = {name.removesuffix(".weight") for name in tensors if name.endswith(".weight")}
    if config.get("tie_word_embeddings"):
        modules.add("lm_head")  # a tied head is a module whose weight the checkpoint stores once, as the embedding
    missing = [t for t in spec.lora.target_modules if not any(m == t or m.endswith(f".{t}") for m in modules)]
    if missing:
        projections = sorted({m.rsplit(".", 1)[-1] for m in modules if m.endswith("proj")})
        raise RecipeError(f"recipe key models.student.lora.target_modules: {', '.join(missing)} match no module of "
                          f"{spec.id}; its projections are {', '.join(projections)}")
    return list(spec.lora.target_modules)


def check_one_base(student_dir: Path, teacher_dir: Path) -> Path:
    if teacher_dir.resolve() != student_dir.resolve():
        raise IncompatibleModelsError(
            f"recipe key models.teacher.path: shared_backbone loads one base, but the student resolves to "
            f"{student_dir} and the teacher to {teacher_dir}; name the same directory or use dual_model")
    return student_dir


def refuse_unused_adapter(runtime: str) -> None:
    raise RecipeError(f"recipe key models.teacher.adapter: {runtime} never loads a teacher adapter (only "
                      "shared_backbone does); remove the adapter or set models.runtime: shared_backbone")


def _check_runtime(recipe: Recipe, dirs: dict[str, Path], refusals: Refusals) -> TeacherAdapter | None:
    student, teacher = recipe.models.student, recipe.models.teacher
    if recipe.models.runtime != "shared_backbone":
        if teacher.adapter is not None:
            refusals.check(refuse_unused_adapter, recipe.models.runtime)
        return None
    assert teacher.adapter is not None, "core.recipe's consistency rules require the adapter"
    refusals.check(check_one_base, dirs["student"], dirs["teacher"])
    return refusals.check(check_teacher_adapter, teacher.adapter, student.id, student.revision)


def load_student_tokenizer(directory: Path) -> Any:
    try:
        return load_tokenizer(directory)
    except ImportError:
        raise
    except Exception as exc:  # transformers and tokenizers raise many types (JSONDecodeError, bare Exception)
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise UserError(f"models.student: the tokenizer in {directory} does not load ({first}); "
                        "restore its tokenizer files") from None
