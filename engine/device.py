"""Device, dtype and memory-strategy resolution, and environment provenance.

There is no GPU allowlist: `auto` means CUDA whenever PyTorch can use it.
Every `auto` resolves to a value plus the reason, which preflight records.
"""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from .errors import RecipeError
from .recipe import Recipe


@dataclass(frozen=True)
class Resolved:
    value: str
    reason: str


def resolve_device(requested: str) -> Resolved:
    usable = torch.cuda.is_available()
    if requested == "cuda" and not usable:
        raise RecipeError("recipe key models.device: cuda requested but PyTorch cannot use a CUDA device here; use auto or cpu")
    if requested == "cpu":
        return Resolved("cpu", "requested by the recipe")
    if requested == "cuda" or usable:
        name = torch.cuda.get_device_name(0)
        why = "requested by the recipe" if requested == "cuda" else "auto: PyTorch can use CUDA"
        return Resolved("cuda", f"{why} ({name})")
    return Resolved("cpu", "auto: no CUDA device usable by PyTorch")


def resolve_dtype(requested: str, device: str) -> Resolved:
    if device == "cpu":
        if requested in ("auto", "float32"):
            return Resolved("float32", "CPU computes in float32")
        raise RecipeError(f"recipe key dtype: {requested} is not supported on CPU; use auto or float32")
    if requested != "auto":
        if requested == "bfloat16" and not torch.cuda.is_bf16_supported():
            raise RecipeError("recipe key dtype: this GPU has no bfloat16 path; use auto or float16")
        return Resolved(requested, "requested by the recipe")
    major, minor = torch.cuda.get_device_capability(0)
    if torch.cuda.is_bf16_supported() and major >= 8:
        return Resolved("bfloat16", f"auto: compute capability {major}.{minor} supports bfloat16")
    return Resolved("float16", f"auto: compute capability {major}.{minor} has no bfloat16 path")


def resolve_memory_strategy(requested: str, quantized_student: bool, device: str) -> Resolved:
    if requested == "swap" and quantized_student:
        raise RecipeError(
            "recipe key memory.strategy: swap cannot move an NF4 (bitsandbytes) student between devices; use resident or auto"
        )
    if requested != "auto":
        return Resolved(requested, "requested by the recipe")
    if device == "cpu":
        return Resolved("resident", "auto: on CPU there is nothing to swap to")
    if quantized_student:
        return Resolved("resident", "auto: a quantized student stays resident (bitsandbytes modules are never moved)")
    return Resolved("resident", "auto: resident unless the recipe asks for swap")


def resolve_optimizer(requested: str, device: str) -> Resolved:
    if requested == "paged_adamw_8bit" and device == "cpu":
        raise RecipeError("recipe key optimizer.name: paged_adamw_8bit needs a CUDA device; use auto or adamw")
    if requested != "auto":
        return Resolved(requested, "requested by the recipe")
    if device == "cuda":
        return Resolved("paged_adamw_8bit", "auto: bitsandbytes paged 8-bit AdamW on CUDA")
    return Resolved("adamw", "auto: plain AdamW on CPU")


def check_quantization(quantization: str, device: str) -> None:
    if quantization == "nf4" and device == "cpu":
        raise RecipeError(
            "recipe key models.student.quantization: nf4 needs a CUDA device here; use quantization: none on CPU"
        )


def resolve_all(recipe: Recipe) -> dict[str, Resolved]:
    device = resolve_device(recipe.models.device)
    quantized = recipe.models.student.quantization == "nf4"
    check_quantization(recipe.models.student.quantization, device.value)
    return {
        "device": device,
        "dtype": resolve_dtype(recipe.dtype, device.value),
        "memory.strategy": resolve_memory_strategy(recipe.memory.strategy, quantized, device.value),
        "optimizer.name": resolve_optimizer(recipe.optimizer.name, device.value),
    }


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


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
        env[package] = _version(package)
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
            torch.cuda.synchronize()
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


def _max_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
