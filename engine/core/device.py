"""Device, dtype and memory-strategy resolution, and environment provenance.

There is no GPU allowlist: `auto` means CUDA whenever PyTorch can use it.
Every `auto` resolves to a value plus the reason, which preflight records.
"""

from __future__ import annotations

import atexit
import functools
import gc
import importlib.metadata
import importlib.util
import platform
import subprocess
from contextlib import contextmanager
from typing import Iterator

import torch

from miniverl.engine.core.artifacts import Resolution  # a resolved `auto`: what it became here and why
from miniverl.engine.core.errors import RecipeError
from miniverl.engine.core.recipe import Recipe


def cuda_problem() -> str | None:
    """None when PyTorch can run a kernel on CUDA device 0; otherwise why it cannot."""
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (a CPU-only PyTorch build, or no usable driver or device)"
    try:
        torch.ones(1, device="cuda").add_(1).item()
    except RuntimeError as exc:  # e.g. a GPU architecture this PyTorch build has no kernels for
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        return f"PyTorch sees a CUDA device but cannot run a kernel on it ({first})"
    return None


def _gpu_description() -> str:
    major, minor = torch.cuda.get_device_capability(0)
    return f"{torch.cuda.get_device_name(0)}, compute capability {major}.{minor}"


def resolve_device(requested: str) -> Resolution:
    """`auto`: CUDA whenever PyTorch can use it, whatever the card is called; CPU otherwise."""
    if requested == "cpu":
        return Resolution("cpu", "requested by the recipe")
    problem = cuda_problem()
    if problem is None:
        why = "requested by the recipe" if requested == "cuda" else "auto: PyTorch can use CUDA"
        return Resolution("cuda", f"{why} ({_gpu_description()})")
    if requested == "cuda":
        raise RecipeError(f"recipe key models.device: cuda requested but {problem}; use auto or cpu")
    return Resolution("cpu", f"auto: no CUDA device usable by PyTorch: {problem}")


def native_bf16() -> bool:
    """bfloat16 arithmetic in hardware: compute capability 8.0 and up (PyTorch emulates it below)."""
    major, _ = torch.cuda.get_device_capability(0)
    return major >= 8 and torch.cuda.is_bf16_supported()


def resolve_dtype(requested: str, device: str) -> Resolution:
    """`auto`: bfloat16 where the GPU computes it natively, float16 otherwise (e.g. 7.0), float32 on CPU."""
    if device == "cpu":
        if requested in ("auto", "float32"):
            return Resolution("float32", "CPU computes in float32")
        raise RecipeError(f"recipe key dtype: {requested} is not supported on CPU; use auto or float32")
    major, minor = torch.cuda.get_device_capability(0)
    if requested != "auto":
        if requested == "bfloat16" and not native_bf16():
            raise RecipeError(f"recipe key dtype: this GPU (compute capability {major}.{minor}) has no bfloat16 "
                              "path; use auto or float16")
        return Resolution(requested, "requested by the recipe")
    if native_bf16():
        return Resolution("bfloat16", f"auto: compute capability {major}.{minor} supports bfloat16")
    return Resolution("float16", f"auto: compute capability {major}.{minor} has no native bfloat16; float16 instead")


def resolve_memory_strategy(requested: str, quantized_student: bool, device: str) -> Resolution:
    """`swap` moves only unquantized models; an NF4 student stays resident under every strategy."""
    if device == "cpu":
        return Resolution("resident", f"{requested}: on CPU every model is resident; there is nothing to swap to")
    if requested == "swap":
        if quantized_student:
            return Resolution("swap", "requested by the recipe: the unquantized teacher waits in CPU memory while a "
                                    "stage does not use it; the NF4 student stays resident (bitsandbytes modules "
                                    "are never moved)")
        return Resolution("swap", "requested by the recipe: a model waits in CPU memory while a stage does not use it")
    if requested == "resident":
        return Resolution("resident", "requested by the recipe")
    if quantized_student:
        return Resolution("resident", "auto: the student is NF4-quantized, and bitsandbytes modules are never moved "
                                    "between devices, so both models stay resident")
    return Resolution("resident", "auto: resident (no transfers between stages); set memory.strategy: swap to keep "
                                "the idle model in CPU memory")


def resolve_optimizer(requested: str, device: str) -> Resolution:
    if requested == "paged_adamw_8bit" and device == "cpu":
        raise RecipeError("recipe key optimizer.name: paged_adamw_8bit needs a CUDA device; use auto or adamw")
    if requested != "auto":
        return Resolution(requested, "requested by the recipe")
    if device == "cuda":
        return Resolution("paged_adamw_8bit", "auto: bitsandbytes paged 8-bit AdamW on CUDA")
    return Resolution("adamw", "auto: plain AdamW on CPU")


def resolve_activation_offload(requested: bool | str, checkpointing: bool, device: str) -> Resolution:
    """train.offload_activations: the checkpointed layers' inputs in host memory during the gradient stage."""
    if requested is True and not checkpointing:
        raise RecipeError("recipe key train.offload_activations: true offloads the inputs gradient checkpointing "
                          "keeps; set train.gradient_checkpointing: true, or offload_activations: auto")
    if requested is not True and requested is not False:  # auto
        if not checkpointing:
            return Resolution("false", "auto: train.gradient_checkpointing is off, so no layer input is kept to "
                                       "offload")
        if not device.startswith("cuda"):
            return Resolution("false", "auto: on CPU the kept layer inputs are in host memory already")
        return Resolution("true", "auto: each checkpointed layer's input waits in pinned host memory until its "
                                "backward (one copy out, one back, per layer)")
    return Resolution("true" if requested else "false", "requested by the recipe")


def offloads_activations(recipe: Recipe, device: str) -> bool:
    train = recipe.train
    return resolve_activation_offload(train.offload_activations, train.gradient_checkpointing, device).value == "true"


@functools.lru_cache(maxsize=1)
def _liger_problem() -> str | None:
    """Why liger-kernel's two ops cannot be used here, or None. Imported once: an install whose Triton does
    not suit it fails here, at the start of a run, rather than in the middle of the gradient stage."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel)"
    try:
        from liger_kernel.ops import LigerRMSNormFunction, LigerSiLUMulFunction  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: not usable here, say why
        return f"liger-kernel does not import here ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
    return None


def resolve_fused_kernels(requested: bool | str, device: str) -> Resolution:
    """train.fused_kernels: liger-kernel's RMSNorm and SiLU-mul in the gradient stage's student layers."""
    if requested is False:
        return Resolution("false", "requested by the recipe")
    if not device.startswith("cuda"):
        if requested is True:
            raise RecipeError("recipe key train.fused_kernels: true needs a CUDA device (the kernels are Triton); "
                              "use auto or false")
        return Resolution("false", "auto: the kernels are Triton, CUDA only; the module path here")
    problem = _liger_problem()
    if problem is not None:
        if requested is True:
            raise RecipeError(f"recipe key train.fused_kernels: true, but {problem}; fix that, or use auto or false")
        return Resolution("false", f"auto: {problem}; the module path")
    if requested is True:
        return Resolution("true", "requested by the recipe")
    return Resolution("true", "auto: liger-kernel's RMSNorm and SiLU-mul in the student's layers while it trains")


def uses_fused_kernels(recipe: Recipe, device: str) -> bool:
    return resolve_fused_kernels(recipe.train.fused_kernels, device).value == "true"


def check_quantization(quantization: str, device: str) -> None:
    if quantization == "nf4" and device == "cpu":
        raise RecipeError(
            "recipe key models.student.quantization: nf4 needs a CUDA device here; use quantization: none on CPU"
        )


def resolve_all(recipe: Recipe) -> dict[str, Resolution]:
    device = resolve_device(recipe.models.device)
    quantized = recipe.models.student.quantization == "nf4"
    check_quantization(recipe.models.student.quantization, device.value)
    return {
        "device": device,
        "dtype": resolve_dtype(recipe.dtype, device.value),
        "memory.strategy": resolve_memory_strategy(recipe.memory.strategy, quantized, device.value),
        "optimizer.name": resolve_optimizer(recipe.optimizer.name, device.value),
        "train.offload_activations": resolve_activation_offload(recipe.train.offload_activations,
                                                                recipe.train.gradient_checkpointing, device.value),
        "train.fused_kernels": resolve_fused_kernels(recipe.train.fused_kernels, device.value),
    }


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def package_version(name: str) -> str | None:
    """The installed distribution's version, None when it is not installed (callers word the absence)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "none"


def environment() -> dict[str, str]:
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": str(torch.__version__),
        "cuda_build": str(torch.version.cuda),
        "cuda_available": str(torch.cuda.is_available()),
    }
    for package in ("transformers", "peft", "bitsandbytes", "msgspec", "tokenizers", "safetensors"):
        env[package] = package_version(package) or "not installed"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_memory_gib"] = f"{props.total_memory / 2**30:.2f}"
        env["compute_capability"] = f"{props.major}.{props.minor}"
        env["driver"] = driver_version()
    return env


class PeakMemory:
    """Peak memory of one stage: CUDA allocated/reserved counters reset per stage."""

    def __init__(self, device: str):
        self.device = device
        self.allocated = 0
        self.reserved = 0

    @contextmanager
    def track(self) -> Iterator["PeakMemory"]:
        if self.device == "cuda":
            # What the previous stage left to the garbage collector (reference cycles
            # holding CUDA tensors: a decoder's KV cache, a graph's pool) must not
            # count against this stage, nor stay allocated while it runs.
            collect_garbage()
            torch.cuda.synchronize()
            # cuBLAS keeps a workspace per (handle, stream) it has seen, also for streams
            # a finished stage created and dropped; the next GEMM re-creates the one it needs.
            getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            yield self
        finally:
            if self.device == "cuda":
                torch.cuda.synchronize()
                self.allocated = torch.cuda.max_memory_allocated()
                self.reserved = torch.cuda.max_memory_reserved()
            else:
                self.allocated = _max_rss_bytes()


def collect_garbage() -> None:
    """A full collection, then what survives it frozen out of later ones.

    What is alive between stages (the imported libraries, the host's models) stays for the process: frozen,
    each later collection scans only what stages made since. A full collection of a process with torch and
    transformers loaded took ~0.35 s a stage on the H200 host (cProfile of the 4 GiB calc cycle,
    results/cycle_profile_h200_before.json). Frozen objects are still freed by reference counting; only a
    reference cycle among them would outlive its last user. Unfrozen at exit, so the interpreter's last
    collection still finalizes them (nanobind reports leaks otherwise).
    """
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)


def _max_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
