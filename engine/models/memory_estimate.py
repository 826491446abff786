"""An analytic memory estimate per stage, from the model configs and the recipe budgets.

Nothing is loaded: parameter counts come from `config.json` (cross-checked
against the safetensors headers when the weights are on disk), and every term
is a product of sizes the recipe fixes. It is an estimate to catch a recipe
that cannot fit, not a promise that one will; only a real run proves the fit.

    weights      params x bytes per dtype; an NF4 student ~0.5 byte per linear
                 weight + double-quantized absmax (~1/64 byte), the rest in dtype
    adapter      LoRA params (fp32) [+ grads] [+ the optimizer's fp32 copy and its
                 moments: AdamW 8 bytes/param, paged 8-bit AdamW 2 bytes/param]
    KV cache     layers x kv_heads x head_dim x 2 (K and V) x bytes x tokens x batch
    activations  the tokens x widths a forward keeps (all layers when a backward follows)
    chunk        loss.chunk_size (or a sampling batch) x vocab x 4 bytes x temporaries (8 bytes, plus
                 float64 copies of the heads, for a float32 model)
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from miniverl.engine.core import layout
from miniverl.engine.core.device import offloads_activations
from miniverl.engine.core.recipe import Recipe

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit codes + 8-bit absmax per 64 + fp32 per 256 absmax
FP32 = 4
# What the process needs besides tensors: the CUDA context, or Python with torch and transformers imported.
RUNTIME_OVERHEAD = {"cuda": 512 * 2**20, "cpu": 768 * 2**20}
LOSS_TEMPORARIES = {"exact": 9, "sampled_kl": 4, "topk_tail": 4}  # the unfused loop's float32 [C, V] tensors, measured
SAMPLING_TEMPORARIES = 3  # logits, softmax, sorted copy for top-p


@dataclass(frozen=True)
class ModelShape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    qk_norm: bool  # Qwen3 normalises q and k per head
    qkv_bias: bool  # Qwen2 always has biases on q, k and v; Llama and Qwen3 when attention_bias is set
    o_bias: bool  # attention_bias also biases o_proj, except in Qwen2 (whose modeling code ignores it)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection of one layer, by module name."""
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }


def model_shape(config: dict[str, Any]) -> ModelShape:
    config = config.get("text_config", config)  # multimodal wrappers keep the LM under text_config
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    model_type = str(config.get("model_type", ""))
    attention_bias = bool(config.get("attention_bias", False))
    return ModelShape(
        vocab=int(config["vocab_size"]),
        hidden=hidden,
        layers=int(config["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate=int(config["intermediate_size"]),
        tied=bool(config.get("tie_word_embeddings", False)),
        qk_norm=model_type.startswith("qwen3"),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=model_type != "qwen2" and attention_bias,
    )


def parameter_counts(shape: ModelShape) -> tuple[int, int]:
    """(all parameters, those in the per-layer linear weights that NF4 quantizes)."""
    linear = shape.layers * sum(a * b for a, b in shape.linear_shapes().values())
    per_layer_small = 2 * shape.hidden  # input and post-attention norms
    per_layer_small += 2 * shape.head_dim if shape.qk_norm else 0
    per_layer_small += (shape.q_dim + 2 * shape.kv_dim) if shape.qkv_bias else 0
    per_layer_small += shape.hidden if shape.o_bias else 0
    embeddings = shape.vocab * shape.hidden * (1 if shape.tied else 2)
    total = linear + shape.layers * per_layer_small + shape.hidden + embeddings
    return total, linear


def lora_parameters(shape: ModelShape, target_modules: list[str], r: int) -> int:
    """r x (in + out) for each targeted projection of each layer (A is r x in, B is out x r)."""
    shapes = shape.linear_shapes()
    return shape.layers * sum(r * (shapes[m][0] + shapes[m][1]) for m in target_modules if m in shapes)


def checkpoint_tensors(model_dir: Path) -> dict[str, int] | None:
    """Tensor name -> element count from the safetensors headers; None without them.

    `get_slice(...).get_shape()` reads the header only: no tensor is loaded."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    counts: dict[str, int] = {}
    for file in files:
        with safe_open(file, framework="pt") as checkpoint:
            for name in checkpoint.keys():
                counts[name] = math.prod(checkpoint.get_slice(name).get_shape())
    return counts


# ---------------------------------------------------------------- free memory
def _meminfo(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_ram() -> int | None:
    found = _meminfo("MemAvailable")
    if found is None:
        try:
            import psutil

            found = int(psutil.virtual_memory().available)
        except ImportError:
            return None
    return found


def total_ram() -> int | None:
    found = _meminfo("MemTotal")
    if found is None:
        try:
            found = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return found


def total_memory(device: str) -> tuple[int | None, str]:
    """All the memory `device` has, free or not: a stage that needs more can never run there."""
    if device == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(0)[1]), f"{torch.cuda.get_device_name(0)} has"
    return total_ram(), "this machine has"


def free_memory(device: str) -> tuple[int | None, str]:
    """Bytes free for this run on `device`, and where the figure comes from."""
    if device == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(0)
        return int(free), f"CUDA free memory on {torch.cuda.get_device_name(0)} ({total / 2**30:.1f} GiB total)"
    return available_ram(), "available RAM (MemAvailable)"


# ---------------------------------------------------------------- per stage
@dataclass(frozen=True)
class StageEstimate:
    stage: str
    weights: int
    adapter: int
    kv_cache: int
    activations: int
    chunk_tensors: int
    runtime: int

    @property
    def total(self) -> int:
        return self.weights + self.adapter + self.kv_cache + self.activations + self.chunk_tensors + self.runtime

    @property
    def allocated(self) -> int:
        """What the run's tensors take: the total less the CUDA context or interpreter."""
        return self.total - self.runtime

    def as_dict(self) -> dict[str, int | str]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class Sizes:
    """The batch sizes a plan fixes: sequences per rollout batch, trajectories per gradient and teacher-score pass."""

    generation: int
    micro: int
    score: int


def recipe_sizes(recipe: Recipe) -> Sizes:
    """The recipe's own sizes (every `auto` already resolved)."""
    return Sizes(recipe.rollout.generation_batch_size, recipe.train.trajectory_batch_size, recipe.train.score_batch)


# cuBLAS workspaces, CUDA-graph pools, index and mask tensors, allocator rounding: measured 0.1 GiB
# beside a rollout's KV caches on an H200 (benchmarks/results/gradient_profile_h200.json).
WORKSPACE = 128 * 2**20


def fused_loss(recipe: Recipe, device: str, dtype: str) -> bool:
    """Whether the gradient stage takes the Triton exact loss (losses.fused_exact_applies, decided here from the recipe)."""
    return recipe.loss.mode == "exact" and device == "cuda" and dtype in ("bfloat16", "float16")


def dense_copy_applies(recipe: Recipe, device: str) -> bool:
    """Whether `rollout.dense_copy` can mean anything: an NF4 student decoded by the CUDA-graph engine."""
    return recipe.models.student.quantization == "nf4" and device == "cuda" and recipe.rollout.engine != "plain"


def estimate(recipe: Recipe, student: ModelShape, teacher: ModelShape, device: str, dtype: str,
             optimizer: str, strategy: str, sizes: Sizes | None = None) -> list[StageEstimate]:
    """Each stage's memory at `sizes` (default: the recipe's own batch sizes)."""
    sizes = sizes or recipe_sizes(recipe)
    b = DTYPE_BYTES[dtype]
    s_total, s_linear = parameter_counts(student)
    t_total, _ = parameter_counts(teacher)
    nf4 = recipe.models.student.quantization == "nf4"
    student_w = int(s_linear * NF4_BYTES_PER_PARAM + (s_total - s_linear) * b) if nf4 else s_total * b
    teacher_w = t_total * b
    teacher_head = teacher.vocab * teacher.hidden * b
    exact = recipe.loss.mode == "exact"
    lora = lora_parameters(student, recipe.models.student.lora.target_modules, recipe.models.student.lora.r) * FP32
    moments = 2 if optimizer == "paged_adamw_8bit" else 8  # bytes per parameter for the two moments
    swap = strategy == "swap" and device == "cuda" and recipe.models.runtime == "dual_model"

    # rollout.dense_copy: the student's quantized linears once more, in the compute dtype, while it samples.
    dense_copy = s_linear * b if dense_copy_applies(recipe, device) and recipe.rollout.dense_copy is True else 0

    def weights(stage: str) -> int:
        """Resident: both models stay. Swap: an unused teacher waits in host memory (its head stays from
        the gradient stage through the optimizer step in exact mode); an unquantized student's base waits
        while the teacher scores (NF4 never moves)."""
        if not swap:
            return student_w + teacher_w
        if stage in (layout.PREFLIGHT, layout.TEACHER_SCORE):
            return (student_w if nf4 or stage == layout.PREFLIGHT else 0) + teacher_w
        head = teacher_head if exact and stage in (layout.GRADIENT, layout.OPTIMIZER_STEP) else 0
        return student_w + head

    r, train, v = recipe.rollout, recipe.train, recipe.verify
    tokens = r.max_total_tokens
    rollout_batch = min(sizes.generation, train.rollouts_per_cycle)
    verify_batch = min(v.batch_size, recipe.task.heldout_size)
    micro, score = min(sizes.micro, train.rollouts_per_cycle), min(sizes.score, train.rollouts_per_cycle)
    chunk = recipe.loss.chunk_size

    def kv(shape: ModelShape, batch: int) -> int:
        return shape.layers * shape.kv_heads * shape.head_dim * 2 * b * tokens * batch

    def one_layer(shape: ModelShape, batch: int) -> int:
        """A no-grad forward frees each layer's tensors before the next: one layer's worth (the norms'
        float32 upcasts, q/k/v and their rotations, the MLP's gate, up, activation and product) and its
        output. Calibrated on an H200: 170 KB a token for Qwen3-1.7B (16 H + 8 I bytes in bf16 is 164 KB,
        the workspace term covers the rest; benchmarks/results/cycle_bench_h200.json)."""
        return batch * tokens * (16 * shape.hidden + 8 * shape.intermediate) * b

    offloaded = offloads_activations(recipe, device)

    def all_layers(shape: ModelShape, batch: int) -> int:
        """A backward needs every layer's inputs: norms, q/k/v, attention output, the MLP's gate, up, product
        and their LoRA intermediates. With gradient checkpointing only each layer's input is kept, plus one
        layer recomputed at a time. The predicting hidden states and their gradient come on top.
        Calibrated on an H200: 164 KB a token for Qwen3-0.6B with checkpointing (this gives 166 KB)."""
        per_token = 20 * shape.hidden + 2 * shape.q_dim + 2 * shape.kv_dim + 8 * shape.intermediate
        gathered = 3 * shape.hidden
        if train.gradient_checkpointing:
            kept = 0 if offloaded else shape.layers * shape.hidden  # train.offload_activations: in host memory
            return batch * tokens * (kept + per_token + gathered) * b
        return batch * tokens * (shape.layers * per_token + gathered) * b

    def sampling(shape: ModelShape, batch: int) -> int:
        return batch * shape.vocab * FP32 * SAMPLING_TEMPORARIES

    # teacher_score's chunk: the bf16 logits and their float32 log-softmax (the float32 upcast is freed into it).
    teacher_chunk = 0 if exact else chunk * teacher.vocab * (b + FP32)
    # A float32 model's loss logits are float64, from float64 copies of the heads (losses._chunk_logits).
    loss_bytes = 2 * FP32 if b == FP32 else FP32
    head_copies = (student.vocab * student.hidden + (teacher.vocab * teacher.hidden if exact else 0)) * 2 * FP32 \
        if b == FP32 else 0
    if fused_loss(recipe, device, dtype):  # the two GEMM outputs, in the heads' dtype, are the only [C, V] tensors
        loss_chunk = chunk * (student.vocab + teacher.vocab) * b
    else:
        loss_chunk = chunk * student.vocab * loss_bytes * LOSS_TEMPORARIES[recipe.loss.mode] + head_copies
    overhead = RUNTIME_OVERHEAD[device]
    work = WORKSPACE if device == "cuda" else 0
    return [
        StageEstimate(layout.PREFLIGHT, weights(layout.PREFLIGHT), lora, 0, 0, 0, overhead),
        StageEstimate(layout.VERIFY, weights(layout.VERIFY), lora, kv(student, verify_batch),
                      one_layer(student, verify_batch) + work, sampling(student, verify_batch), overhead),
        StageEstimate(layout.ROLLOUT, weights(layout.ROLLOUT) + dense_copy, lora, kv(student, rollout_batch),
                      one_layer(student, rollout_batch) + work, sampling(student, rollout_batch), overhead),
        StageEstimate(layout.TEACHER_SCORE, weights(layout.TEACHER_SCORE), lora, 0, one_layer(teacher, score) + work,
                      teacher_chunk, overhead),
        # The adapter and its gradient (the float64 sum of the micro-batches' gradients is in host memory).
        StageEstimate(layout.GRADIENT, weights(layout.GRADIENT), 2 * lora, 0, all_layers(student, micro) + work,
                      loss_chunk, overhead),
        StageEstimate(layout.OPTIMIZER_STEP, weights(layout.OPTIMIZER_STEP), 3 * lora + lora // FP32 * moments, 0,
                      work, 0, overhead),
    ]


# The recipe key that sizes each term, for the line that refuses a plan; the first named is the one to lower.
_TERM_KEYS = {
    "kv_cache": "rollout.max_total_tokens",
    "activations": "rollout.max_total_tokens",
    "chunk_tensors": "loss.chunk_size",
    "adapter": "models.student.lora.r",
    "weights": "models",
}
_BATCH_KEYS = {layout.ROLLOUT: "rollout.generation_batch_size", layout.VERIFY: "verify.batch_size",
               layout.GRADIENT: "train.trajectory_batch_size", layout.TEACHER_SCORE: "train.trajectory_batch_size"}


def impossible_plan(stages: list[StageEstimate], device: str) -> str | None:
    """The line refusing a plan whose largest stage exceeds all of the device's memory, or None.

    Only what can never fit is refused (free memory changes from minute to minute; `--dry-run` shows it)."""
    total, source = total_memory(device)
    largest = max(stages, key=lambda stage: stage.total)
    if total is None or largest.total <= total:
        return None
    term = max(_TERM_KEYS, key=lambda name: getattr(largest, name))
    key = _TERM_KEYS[term]
    batch = f" (with {_BATCH_KEYS[largest.stage]})" if term in ("kv_cache", "activations") and largest.stage in _BATCH_KEYS else ""
    return (f"recipe key {key}: the {largest.stage} stage would need about {largest.total / 2**30:,.1f} GiB "
            f"({term.replace('_', ' ')} {getattr(largest, term) / 2**30:,.1f} GiB) and {source} "
            f"{total / 2**30:,.1f} GiB in all; lower {key}{batch}")


def memory_refusal(recipe: Recipe, configs: dict[str, dict[str, Any] | None], device: str, dtype: str,
                   optimizer: str, strategy: str) -> str | None:
    """`impossible_plan` for the located models' configs (None when a config is not a dense transformer's)."""
    try:
        student, teacher = (model_shape(configs[role] or {}) for role in ("student", "teacher"))
    except (KeyError, TypeError, ValueError):
        return None
    return impossible_plan(estimate(recipe, student, teacher, device, dtype, optimizer, strategy), device)
