"""PEFT adapter directories: written with peft's own `save_pretrained`, read back for `eval`.

The directory is what TRL, vLLM (`--lora-modules`), SGLang and
`PeftModel.from_pretrained` load: `adapter_config.json` in peft's schema and
`adapter_model.safetensors` under peft's standard key names
(`base_model.model.<module>.lora_A.weight`, no adapter name), where `<module>`
is the Hugging Face model's own module path. Inside a run the same tensors are
named as the live peft model names them (`...lora_A.default.weight`).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from miniverl.engine.core.atomic_io import sha256_file
from miniverl.engine.core.errors import IncompatibleModelsError, UserError
from miniverl.engine.core.recipe import LoraSpec, StudentSpec
from miniverl.engine.models.loading import (
    ADAPTER_WEIGHTS, TOKENIZER_FILES, attach_lora, load_adapter_state, load_causal_lm, read_config,
)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_NAME = "default"  # the name peft gives the one adapter of a model; stripped from the saved keys
# What a tokenizer directory holds besides the vocabulary files: the chat template and the special tokens.
TOKENIZER_EXTRAS = ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json", "added_tokens.json")


def run_name(name: str) -> str:
    """`...q_proj.lora_A.weight`, the name peft saves and loaders read -> `...q_proj.lora_A.default.weight`."""
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.weight", f".{part}.{ADAPTER_NAME}.weight")
    return name


def student_on_cpu(student_dir: Path, lora: LoraSpec, adapter: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The unquantized student base in float32 with the adapter loaded: what export saves and merges.

    The LoRA weights do not depend on how the base was stored while training
    (NF4 or not), so no GPU is needed to export an NF4-trained adapter.
    """
    base = load_causal_lm(student_dir, torch.float32, "cpu")
    model = attach_lora(base, lora, seed=0)  # the draw is overwritten by the checkpoint's weights
    load_adapter_state(model, adapter)
    return model


def save_adapter(model: torch.nn.Module, directory: Path, student: StudentSpec) -> None:
    """peft's own `save_pretrained`, naming the base as the recipe names it (id + revision)."""
    config = model.peft_config[ADAPTER_NAME]
    config.base_model_name_or_path, config.revision = student.id, student.revision
    config.inference_mode = True
    # save_embedding_layers=False: the embeddings are not adapted, and "auto" would look the base up on the hub.
    model.save_pretrained(str(directory), save_embedding_layers=False)
    # peft keeps target_modules as a set, so their order in the file changes from process to process;
    # sorted, the same checkpoint always exports to the same bytes.
    path = directory / ADAPTER_CONFIG
    saved = json.loads(path.read_text(encoding="utf-8"))
    saved["target_modules"] = sorted(saved["target_modules"])
    path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def readable_by_all(directory: Path) -> None:
    """Files as the umask allows (safetensors writes 0600), so a server running as another user can read them."""
    umask = os.umask(0)
    os.umask(umask)
    for file in directory.rglob("*"):
        if file.is_file():
            file.chmod(0o666 & ~umask)


def save_merged(model: torch.nn.Module, directory: Path, student_dir: Path) -> str:
    """The base with the adapter merged in, in the base's own unquantized dtype; returns that dtype's name."""
    config = read_config(student_dir)
    dtype_name = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    merged = model.merge_and_unload()  # W + (alpha / r) B A, computed in float32
    merged.to(getattr(torch, dtype_name))
    merged.save_pretrained(str(directory))
    return dtype_name


def copy_tokenizer(student_dir: Path, directory: Path) -> None:
    """The run's tokenizer files and chat template, byte for byte."""
    for name in (*TOKENIZER_FILES, *TOKENIZER_EXTRAS):
        if (student_dir / name).is_file():
            shutil.copyfile(student_dir / name, directory / name)


# ---------------------------------------------------------------- reading one back
# peft features miniverl's student does not have: evaluating such an adapter as plain LoRA would be wrong.
_UNSUPPORTED = {
    "use_dora": lambda v: bool(v), "use_rslora": lambda v: bool(v), "modules_to_save": lambda v: bool(v),
    "rank_pattern": lambda v: bool(v), "alpha_pattern": lambda v: bool(v), "layers_to_transform": lambda v: v is not None,
    "trainable_token_indices": lambda v: bool(v), "lora_bias": lambda v: bool(v), "bias": lambda v: v not in (None, "none"),
    "target_parameters": lambda v: bool(v), "use_qalora": lambda v: bool(v),
}


@dataclass(frozen=True)
class AdapterDir:
    directory: Path
    lora: LoraSpec
    sha256: str  # of adapter_model.safetensors
    base: str | None  # base_model_name_or_path
    state: dict[str, torch.Tensor]  # by the names the run's peft model gives them


def _config(directory: Path) -> dict[str, Any]:
    where = f"--adapter {directory}"
    if not directory.is_dir():
        raise UserError(f"{where}: no such directory; point it at a folder peft's save_pretrained "
                        f"(or `miniverl export-adapter`) wrote")
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{where}: has no {ADAPTER_CONFIG}; point it at a folder peft's save_pretrained "
                        f"(or `miniverl export-adapter`) wrote") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{where}: {ADAPTER_CONFIG} is not readable JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise UserError(f"{where}: peft_type is {config.get('peft_type') if isinstance(config, dict) else None!r}; "
                        f"only LoRA adapters can be evaluated")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise UserError(f"{where}: task_type is {config['task_type']!r}; a student adapter is CAUSAL_LM")
    used = [key for key, is_used in _UNSUPPORTED.items() if key in config and is_used(config[key])]
    if used:
        raise UserError(f"{where}: uses {', '.join(used)}, which miniverl's LoRA student does not have; only plain "
                        f"LoRA adapters (bias none, no modules_to_save) can be evaluated")
    if not isinstance(config.get("target_modules"), list):
        raise UserError(f"{where}: target_modules is {config.get('target_modules')!r}; miniverl needs the list of "
                        f"module names (a regular expression is not supported)")
    return config


def _check_base(directory: Path, config: dict[str, Any], student: StudentSpec, student_dir: Path) -> None:
    base, revision = config.get("base_model_name_or_path"), config.get("revision")
    names = {student.id, student.path, str(student_dir), str(student_dir.resolve())} - {None}
    if base is not None and base not in names:
        raise IncompatibleModelsError(
            f"--adapter {directory} was trained for the base {base}, but the recipe's student is {student.id}; "
            f"evaluate it with a recipe whose models.student names that base")
    if revision is not None and student.revision is not None and revision != student.revision:
        raise IncompatibleModelsError(
            f"--adapter {directory} was trained on revision {revision} of {base}, but the recipe's student is "
            f"revision {student.revision}; use the matching revision")


def read_adapter_dir(directory: Path, student: StudentSpec, student_dir: Path) -> AdapterDir:
    """A PEFT LoRA directory for the recipe's student base, checked; every way it can be wrong is one line."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = _config(directory)
    _check_base(directory, config, student, student_dir)
    try:
        lora = msgspec.convert({"r": config.get("r"), "alpha": config.get("lora_alpha"),
                                "dropout": config.get("lora_dropout") or 0.0,
                                "target_modules": config["target_modules"]}, LoraSpec)
    except msgspec.ValidationError as exc:
        raise UserError(f"--adapter {directory}: {ADAPTER_CONFIG} has an unusable value ({exc})") from None
    weights = directory / ADAPTER_WEIGHTS
    if not weights.is_file():
        other = " (it has adapter_model.bin: save it again with safetensors)" if (directory / "adapter_model.bin").is_file() else ""
        raise UserError(f"--adapter {directory}: has no {ADAPTER_WEIGHTS}{other}")
    try:
        saved = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise UserError(f"--adapter {directory}: {ADAPTER_WEIGHTS} is not a readable safetensors file ({exc})") from None
    return AdapterDir(directory, lora, sha256_file(weights), config.get("base_model_name_or_path"),
                      {run_name(name): tensor for name, tensor in saved.items()})
