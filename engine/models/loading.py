"""Model loading: locate, identify, pair-check, and load student and teacher.

Models come from a local directory, the embedded tiny assets
(`miniverl-builtin/<name>`), or the local Hugging Face cache by id + revision
(never the network at run time). The student gets a peft LoRA adapter,
optionally over NF4 weights from bitsandbytes; the teacher is frozen.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from miniverl.engine.core.atomic_io import sha256_file
from miniverl.engine.core.errors import IncompatibleModelsError, UserError
from miniverl.engine.core.recipe import BUILTIN_PREFIX, LoraSpec, TeacherAdapterSpec

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny"
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model")
# What of tokenizer_config.json changes the tokens a run sees: the chat template (a prompt rendered
# differently is a different context) and the special tokens. Other keys (model_max_length, the
# tokenizer class name) may differ between two checkpoints of one family without changing a token.
TEMPLATE_KEYS = ("chat_template", "added_tokens_decoder", "bos_token", "eos_token", "pad_token", "unk_token",
                 "add_bos_token", "add_eos_token", "additional_special_tokens", "extra_special_tokens")


def locate_model(role: str, model_id: str, revision: str | None, path: str | None) -> Path:
    """The local directory holding a model's config, weights and tokenizer."""
    if path is not None:
        local = Path(path).expanduser()
        if not (local / "config.json").is_file():
            raise UserError(f"recipe key models.{role}.path: {local} has no config.json; point it at a model directory")
        return local
    if model_id.startswith(BUILTIN_PREFIX):
        local = ASSETS_DIR / model_id[len(BUILTIN_PREFIX):]
        if not (local / "config.json").is_file():
            raise UserError(f"recipe key models.{role}.id: no embedded model named {model_id}")
        return local
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_id, revision=revision, local_files_only=True))
    except Exception:  # the hub client raises several types for "not cached"
        raise UserError(
            f"recipe key models.{role}.id: {model_id}@{revision or 'main'} is not in the local Hugging Face cache; "
            f"download it once (`huggingface-cli download {model_id} --revision {revision or 'main'}`) "
            f"or set models.{role}.path"
        ) from None


def tokenizer_sha256(model_dir: Path) -> str:
    """Hash of the files that define tokenization (byte-identity is the pairing rule)."""
    digest = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        file = model_dir / name
        if file.is_file():
            found = True
            digest.update(name.encode() + b"\0" + file.read_bytes())
    if not found:
        raise UserError(f"{model_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    digest.update(b"template\0" + json.dumps(template_settings(model_dir), sort_keys=True).encode())
    return digest.hexdigest()


def template_settings(model_dir: Path) -> dict[str, Any]:
    """The chat template and special-token settings (tokenizer_config.json, chat_template.jinja)."""
    settings: dict[str, Any] = {}
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UserError(f"{config} is not readable JSON: {exc}") from None
        settings = {key: data[key] for key in TEMPLATE_KEYS if key in data}
    jinja = model_dir / "chat_template.jinja"  # transformers >= 4.43 saves the template beside the config
    if jinja.is_file():
        settings["chat_template"] = jinja.read_text(encoding="utf-8")
    return settings


def read_config(model_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{model_dir / 'config.json'} is not readable JSON: {exc}") from None


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@dataclass(frozen=True)
class Pairing:
    compatible: bool
    student_sha256: str
    teacher_sha256: str
    tokenizer_size: int
    student_rows: int
    teacher_rows: int
    reason: str


def check_pairing(student_dir: Path, teacher_dir: Path, tokenizer_size: int) -> Pairing:
    """Byte-identical tokenizers and output vocabularies that cover them."""
    s_hash, t_hash = tokenizer_sha256(student_dir), tokenizer_sha256(teacher_dir)
    s_rows = int(read_config(student_dir)["vocab_size"])
    t_rows = int(read_config(teacher_dir)["vocab_size"])
    if s_hash != t_hash:
        reason = ("tokenizers differ between student and teacher (vocabulary files, chat template or special "
                  "tokens); pick a pair that shares one tokenizer")
    elif min(s_rows, t_rows) < tokenizer_size:
        reason = (
            f"an output vocabulary ({min(s_rows, t_rows)} rows) is smaller than the tokenizer ({tokenizer_size} tokens)"
        )
    else:
        reason = f"identical tokenizers; rows {tokenizer_size}..{max(s_rows, t_rows) - 1} are padding and excluded"
        return Pairing(True, s_hash, t_hash, tokenizer_size, s_rows, t_rows, reason)
    return Pairing(False, s_hash, t_hash, tokenizer_size, s_rows, t_rows, reason)


def require_pairing(pairing: Pairing) -> None:
    if not pairing.compatible:
        raise IncompatibleModelsError(f"student and teacher are incompatible: {pairing.reason}")


def load_causal_lm(model_dir: Path, dtype: torch.dtype, device: str, nf4: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": dtype}
    if nf4:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
        kwargs["device_map"] = {"": 0}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    if not nf4:
        model.to(device)
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def attach_lora(model: torch.nn.Module, lora: LoraSpec, seed: int) -> torch.nn.Module:
    """Wrap with a peft LoRA adapter; initial A matrices are drawn from `seed`."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    peft_model.eval()
    return peft_model


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The trainable adapter parameters, in a stable (sorted) order."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    return dict(sorted(params.items()))


def is_quantized(model: torch.nn.Module) -> bool:
    """True when any weight is a bitsandbytes tensor (such modules are never moved between devices)."""
    return any(type(p).__module__.startswith("bitsandbytes") for p in model.parameters())


def set_gradient_checkpointing(model: torch.nn.Module, enabled: bool, offload: bool = False) -> None:
    """Recompute each decoder layer in the backward instead of keeping its activations.

    Non-reentrant checkpointing, so the frozen (and possibly NF4) base needs no
    inputs that require grad for the LoRA parameters inside a layer to train,
    and the embeddings' output does not.
    `offload`: the layer input each checkpoint keeps waits in host memory
    (`offloaded_checkpoint`). transformers 5.2x renamed the methods
    (`activation_checkpointing_*`); accept both.
    """
    causal = base_model(model)
    if enabled:
        kwargs = {"use_reentrant": False}
        if hasattr(causal, "activation_checkpointing_enable"):
            causal.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            causal.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        # transformers also hooks the embeddings so their output requires grad, which only reentrant
        # checkpointing needs; here it would make that output a leaf that lives, and gets a gradient
        # of its own, through the whole backward (2 x 8 MB at 6 x 704 tokens of Qwen3-0.6B).
        if hasattr(causal, "_require_grads_hook"):
            causal.disable_input_require_grads()
        if offload:  # every checkpointed layer calls its own `_gradient_checkpointing_func`
            for module in causal.modules():
                if getattr(module, "gradient_checkpointing", False):
                    module._gradient_checkpointing_func = offloaded_checkpoint
        return
    if hasattr(causal, "activation_checkpointing_disable"):
        causal.activation_checkpointing_disable()
    else:
        causal.gradient_checkpointing_disable()


def offloaded_checkpoint(function, *args, **kwargs):
    """A non-reentrant checkpoint whose kept inputs live in host memory until the recompute.

    The checkpoint saves only the layer's inputs, through the saved-tensor hooks
    active around it, so these hooks see exactly those tensors. The copies are
    asynchronous on the compute stream into pinned memory: the stream orders
    the copy out before the device block's reuse and the copy back before the
    recompute, and the host allocator keeps a pinned block until its copies end.
    """
    with torch.autograd.graph.saved_tensors_hooks(_to_host, _to_device):
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def _to_host(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
    # A CPU tensor is copied too (unpinned), so the CPU tests run this very path.
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
    host.copy_(tensor, non_blocking=tensor.is_cuda)
    return tensor.device, host


def _to_device(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
    device, tensor = packed
    return tensor.to(device, non_blocking=True)


# --------------------------------------------------------------------------- shared_backbone: the teacher adapter

TEACHER_ADAPTER = "teacher"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class TeacherAdapter:
    """A verified teacher adapter: the directory peft loads and the provenance preflight records."""

    directory: Path
    weights: Path
    sha256: str
    base_id: str
    base_revision: str | None


def check_teacher_adapter(spec: TeacherAdapterSpec, base_id: str, base_revision: str | None) -> TeacherAdapter:
    """The adapter must name the shared base (id + revision) and its weights file must hash to `sha256`.

    `spec.path` is the adapter directory (peft's `save_pretrained` output) or
    the weights file inside it.
    """
    key = "recipe key models.teacher.adapter"
    path = Path(spec.path).expanduser()
    weights = path if path.is_file() else path / ADAPTER_WEIGHTS
    if not weights.is_file() or not (weights.parent / "adapter_config.json").is_file():
        raise UserError(f"{key}.path: {path} holds no peft adapter ({ADAPTER_WEIGHTS} + adapter_config.json); "
                        f"point it at the directory peft's save_pretrained wrote")
    if (spec.base_id, spec.base_revision) != (base_id, base_revision):
        raise IncompatibleModelsError(
            f"{key}.base_id: the teacher adapter was trained on {spec.base_id}@{spec.base_revision}, "
            f"but the shared base is {base_id}@{base_revision}; use an adapter trained on this base revision")
    digest = sha256_file(weights)
    if spec.sha256 is None:
        raise UserError(f"{key}.sha256: missing; {weights} hashes to {digest}, record it so the run can prove "
                        f"which adapter it used")
    if spec.sha256.lower() != digest:
        raise IncompatibleModelsError(f"{key}.sha256: {weights} hashes to {digest}, not the recorded "
                                      f"{spec.sha256}; the file changed or the recipe names another adapter")
    return TeacherAdapter(weights.parent, weights, digest, base_id, base_revision)


def load_teacher_adapter(peft_model: torch.nn.Module, adapter: TeacherAdapter) -> None:
    """Add the frozen teacher adapter beside the student's ('default'), which stays active and trainable."""
    trainable = adapter_parameters(peft_model)
    try:
        peft_model.load_adapter(str(adapter.directory), adapter_name=TEACHER_ADAPTER, is_trainable=False)
    except (RuntimeError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise IncompatibleModelsError(
            f"recipe key models.teacher.adapter.path: the adapter does not fit the shared base ({first})") from None
    peft_model.set_adapter("default")
    restore_requires_grad(peft_model, trainable)


def restore_requires_grad(model: torch.nn.Module, trainable: dict[str, torch.nn.Parameter]) -> None:
    """Exactly the `trainable` parameters require grad (peft's set_adapter re-flags adapters)."""
    for name, param in model.named_parameters():
        param.requires_grad_(name in trainable)


@contextmanager
def active_adapter(peft_model: torch.nn.Module, name: str) -> Iterator[None]:
    """Run the shared base with adapter `name`, then switch back; which parameters train never changes."""
    trainable = adapter_parameters(peft_model)
    previous = peft_model.active_adapter
    peft_model.set_adapter(name)
    restore_requires_grad(peft_model, trainable)
    try:
        yield
    finally:
        peft_model.set_adapter(previous)
        restore_requires_grad(peft_model, trainable)


class _WithAdapter:
    """Calls `module` with one adapter of the shared base active."""

    def __init__(self, peft_model: torch.nn.Module, module: torch.nn.Module, name: str):
        self._peft, self._module, self._name = peft_model, module, name

    def __call__(self, *args, **kwargs):
        with active_adapter(self._peft, self._name):
            return self._module(*args, **kwargs)


class AdapterView:
    """The shared base seen through one adapter: what the stages get as the teacher.

    Calling it (or its `.model`, the decoder body) runs the base with that
    adapter; `lm_head` is the base's head, which LoRA does not touch.
    """

    def __init__(self, peft_model: torch.nn.Module, name: str):
        causal = peft_model.get_base_model()
        self.adapter_name = name
        self.config = causal.config
        self.model = _WithAdapter(peft_model, causal.model, name)
        self.lm_head = causal.lm_head
        self._peft = peft_model
        self._call = _WithAdapter(peft_model, peft_model, name)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The base's weights and this adapter's, not the other adapters'."""
        marker = f".{self.adapter_name}."
        for name, param in self._peft.named_parameters():
            if "lora_" not in name or marker in name:
                yield param


@torch.no_grad()
def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = adapter_parameters(model)
    if set(params) != set(state):
        missing = sorted(set(params) ^ set(state))[:3]
        raise IncompatibleModelsError(f"checkpoint adapter does not fit this student (differs at {missing})")
    for name, param in params.items():
        param.copy_(state[name].to(param.device, param.dtype))


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.Tensor]:
    """The transformer body (hidden states out) and the LM head weight [V, H]."""
    causal = base_model(model)
    return causal.model, causal.lm_head.weight


def cache_kwarg(model: torch.nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache`; accept either."""
    params = inspect.signature(type(base_model(model)).forward).parameters
    return "cache" if "cache" in params else "past_key_values"
