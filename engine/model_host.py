"""Loads each model once per process and hands it to the stages that need it.

Only immutable base weights are cached here; the student's adapter is loaded
from the policy checkpoint by every stage that uses it, so no state passes
between stages except through files. With `memory.strategy: swap` an
unquantized model that the current stage does not need waits in CPU memory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .device import torch_dtype
from .models import (
    adapter_parameters,
    attach_lora,
    load_adapter_state,
    load_causal_lm,
    load_tokenizer,
    locate_model,
)
from .recipe import Recipe
from .seeding import derive_seed


class ModelHost:
    def __init__(self, recipe: Recipe, device: str, dtype: str, memory_strategy: str):
        self.recipe = recipe
        self.device = device
        self.dtype = torch_dtype(dtype)
        self.swap = memory_strategy == "swap"
        self._student = None
        self._teacher = None
        self._tokenizer = None
        s, t = recipe.models.student, recipe.models.teacher
        self.student_dir: Path = locate_model("student", s.id, s.revision, s.path)
        self.teacher_dir: Path = locate_model("teacher", t.id, t.revision, t.path)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.student_dir)
        return self._tokenizer

    @property
    def vocab_limit(self) -> int:
        return len(self.tokenizer)

    def student(self, adapter_state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
        """The student with the given adapter weights loaded (on the compute device)."""
        if self._student is None:
            spec = self.recipe.models.student
            base = load_causal_lm(self.student_dir, self.dtype, self.device, nf4=spec.quantization == "nf4")
            self._student = attach_lora(base, spec.lora, derive_seed(self.recipe.seed, 0, "lora-init"))
        self._place(self._student, self._teacher)
        if adapter_state is not None:
            load_adapter_state(self._student, adapter_state)
        return self._student

    def teacher(self) -> torch.nn.Module:
        if self._teacher is None:
            self._teacher = load_causal_lm(self.teacher_dir, self.dtype, self.device)
        self._place(self._teacher, self._student)
        return self._teacher

    def initial_adapter(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in adapter_parameters(self.student()).items()}

    def _place(self, wanted: torch.nn.Module, other: torch.nn.Module | None) -> None:
        """Swap strategy: the model in use goes to the GPU, an unquantized other one to CPU."""
        if not self.swap or self.device == "cpu":
            return
        if other is not None and not _quantized(other):
            other.to("cpu")
        if not _quantized(wanted):
            wanted.to(self.device)


def _quantized(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(getattr(model, "base_model", None), "is_loaded_in_4bit", False))
