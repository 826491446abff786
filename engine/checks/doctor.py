"""`miniverl doctor`: what this machine offers a run, and what is missing.

Only torch and the standard library are needed: the optional dependencies
(`transformers`, `peft`, `tokenizers` from the `train` extra, `bitsandbytes`
from `cuda`, `tensorboard` for reports) are imported one at a time inside a
guard, so doctor still works, and says what to install, when they are absent
or broken.
"""

from __future__ import annotations

import importlib
import logging
import os
import platform
import sys
from dataclasses import asdict, dataclass

import torch

from miniverl.engine.core.device import cuda_problem, driver_version, native_bf16, package_version, resolve_dtype
from miniverl.engine.models.memory_estimate import available_ram, total_ram

TORCH_SELECTOR = "https://pytorch.org/get-started/locally/"
CUDA_WHEEL_HINT = "pip install torch --index-url https://download.pytorch.org/whl/cu130 (pick the channel for your driver)"


@dataclass(frozen=True)
class Dependency:
    name: str
    purpose: str
    install: str
    status: str  # ok | missing | broken
    version: str | None
    detail: str


OPTIONAL = (
    ("transformers", "model loading (train extra)", 'pip install "miniverl[train]"'),
    ("peft", "LoRA adapters (train extra)", 'pip install "miniverl[train]"'),
    ("tokenizers", "fast tokenizers (train extra)", 'pip install "miniverl[train]"'),
    ("bitsandbytes", "NF4 student and paged 8-bit AdamW on CUDA (cuda extra)", 'pip install "miniverl[cuda]"'),
    ("tensorboard", "TensorBoard scalars (report.tensorboard, optional)", "pip install tensorboard"),
    ("wandb", "Weights & Biases logging (report.wandb, optional)", "pip install wandb"),
)


def _bitsandbytes_library() -> str:
    """Whether bitsandbytes loaded its CUDA kernels (NF4 and paged optimizers need them)."""
    try:
        from bitsandbytes import cextension
    except Exception as exc:  # any failure here is the answer
        return f"native library did not load ({type(exc).__name__}: {exc})"
    backend = getattr(cextension, "BNB_BACKEND", "unknown")
    library = type(getattr(cextension, "lib", None)).__name__
    if library == "CudaBNBNativeLibrary":
        return f"CUDA library loaded (backend {backend})"
    if "ErrorHandler" in library:
        return f"CUDA library failed to load (backend {backend}); NF4 and paged_adamw_8bit will not work"
    return f"CUDA library not loaded (backend {backend}); NF4 and paged_adamw_8bit need a CUDA device"


def check_dependency(name: str, purpose: str, install: str) -> Dependency:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            return Dependency(name, purpose, install, "missing", None, "not installed")
        return Dependency(name, purpose, install, "broken", None, f"import failed: {exc}")
    except Exception as exc:  # a broken install raises anything at all
        return Dependency(name, purpose, install, "broken", None, f"import failed: {type(exc).__name__}: {exc}")
    detail = _bitsandbytes_library() if name == "bitsandbytes" else ""
    return Dependency(name, purpose, install, "ok", package_version(name), detail)


def _cuda_section() -> dict:
    """Usable means a kernel actually ran on device 0, not only that a device is visible."""
    build = torch.version.cuda
    problem = cuda_problem()
    if problem is None:
        why = f"a kernel ran on cuda:0 ({torch.cuda.device_count()} device(s) visible; miniverl uses device 0)"
    elif build is None:
        why = f"this PyTorch wheel is a CPU build; install a CUDA wheel: {CUDA_WHEEL_HINT}"
    elif not torch.cuda.is_available():
        why = (f"PyTorch was built for CUDA {build} but sees no usable device; check `nvidia-smi`, "
               "the driver version and CUDA_VISIBLE_DEVICES")
    else:
        why = f"{problem}; install the PyTorch wheel built for this GPU ({TORCH_SELECTOR})"
    return {"build": build, "usable": problem is None, "why": why}


def _device_section(usable: bool) -> dict:
    if usable:
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        return {
            "kind": "cuda", "name": props.name, "compute_capability": f"{props.major}.{props.minor}",
            "total_memory_bytes": int(total), "free_memory_bytes": int(free), "driver": driver_version(),
            "bf16_supported": native_bf16(),
        }
    return {
        "kind": "cpu", "name": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "total_memory_bytes": total_ram(), "free_memory_bytes": available_ram(), "driver": None,
        "bf16_supported": None,
    }


def collect() -> dict:
    # bitsandbytes (imported by peft too) logs optional-kernel warnings at import time; doctor reports instead.
    for spec in OPTIONAL:
        logging.getLogger(spec[0]).setLevel(logging.CRITICAL)
    cuda = _cuda_section()
    device = _device_section(cuda["usable"])
    auto = resolve_dtype("auto", device["kind"])
    return {
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "torch": str(torch.__version__),
        "cuda": cuda,
        "device": device,
        "dtype_auto": {"value": auto.value, "reason": auto.reason},
        "dependencies": [asdict(check_dependency(*spec)) for spec in OPTIONAL],
    }


def _gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**30:.1f} GiB"


def render(console, report: dict) -> None:
    def row(label: str, text: str) -> None:
        console.print(f"{label:<13} {text}", highlight=False, markup=False)

    cuda, device = report["cuda"], report["device"]
    row("python", f"{report['python']} ({report['platform']})")
    row("torch", f"{report['torch']}, CUDA build: {cuda['build'] or 'none (CPU-only wheel)'}")
    row("CUDA usable", ("yes: " if cuda["usable"] else "no: ") + cuda["why"])
    if device["kind"] == "cuda":
        row("device", f"cuda:0 {device['name']}, compute capability {device['compute_capability']}, "
                      f"{_gib(device['total_memory_bytes'])} total, {_gib(device['free_memory_bytes'])} free, "
                      f"driver {device['driver']}")
        row("bf16", "supported" if device["bf16_supported"] else "not supported (fp16 is used)")
    else:
        row("device", f"cpu {device['name']}, {device['cores']} cores, {_gib(device['total_memory_bytes'])} RAM, "
                      f"{_gib(device['free_memory_bytes'])} available")
        row("bf16", "not used on CPU")
    row("dtype: auto", f"{report['dtype_auto']['value']} ({report['dtype_auto']['reason']})")
    for dep in report["dependencies"]:
        if dep["status"] == "ok":
            text = dep["version"] or "installed"
            text += f"; {dep['detail']}" if dep["detail"] else ""
        else:
            text = f"{dep['detail']}; needed for {dep['purpose']}: {dep['install']}"
        row(dep["name"], text)
    console.print(verdict(report), highlight=False, markup=False)


def verdict(report: dict) -> str:
    deps = {d["name"]: d for d in report["dependencies"]}
    if any(deps[name]["status"] != "ok" for name in ("transformers", "peft", "tokenizers")):
        return 'not ready to train: install the train extra (pip install "miniverl[train]")'
    if report["device"]["kind"] == "cpu":
        return "ready for CPU runs (the embedded tiny recipes); GPU recipes need a CUDA device"
    bnb = deps["bitsandbytes"]
    if bnb["status"] != "ok" or not bnb["detail"].startswith("CUDA library loaded"):
        return ('ready for unquantized recipes; an NF4 student and paged 8-bit AdamW need bitsandbytes with its '
                'CUDA library (pip install "miniverl[cuda]")')
    return "ready: run `miniverl validate RECIPE`, then `miniverl run RECIPE --dry-run`"
