"""Loads each model once per process and hands it to the stages that need it.

Only immutable base weights are cached here; the student's adapter is loaded
from the policy checkpoint by every stage that uses it, so no state passes
between stages except through files.

Runtimes:
- `dual_model`: a student base with a trainable LoRA adapter ('default'), and
  a separate frozen teacher.
- `shared_backbone`: one base, loaded once, carrying the trainable student
  adapter ('default') and a frozen teacher adapter ('teacher'). `teacher()`
  returns a view whose forward switches to the teacher adapter and back.

Memory strategies: `resident` keeps everything on the GPU; `swap` parks the
frozen weights of an unquantized model that the current stage does not use in
pinned host memory (engine.models.offload) and returns the freed blocks to the
driver: the teacher while the student samples, trains or is verified (its head
comes back alone for exact mode's gradient stage), an unquantized student's
base while the teacher scores. bitsandbytes (NF4) models never move.
"""

from __future__ import annotations

from pathlib import Path

import torch

from miniverl.engine.core.device import torch_dtype
from miniverl.engine.models.checks import Refusals, check_models
from miniverl.engine.models.loading import (
    TEACHER_ADAPTER,
    AdapterView,
    Pairing,
    TeacherAdapter,
    adapter_parameters,
    attach_lora,
    decoder_and_head,
    is_quantized,
    load_adapter_state,
    load_causal_lm,
    load_teacher_adapter,
    locate_model,
)
from miniverl.engine.core.recipe import Recipe
from miniverl.engine.core.seeding import derive_seed
from miniverl.engine.models.offload import PinnedWeights


class ModelHost:
    def __init__(self, recipe: Recipe, device: str, dtype: str, memory_strategy: str):
        self.recipe = recipe
        self.device = device
        self.dtype = torch_dtype(dtype)
        self.swap = memory_strategy == "swap" and device != "cpu"
        self._parked: dict[int, PinnedWeights] = {}  # id(model) -> its frozen weights' host copies, under swap
        self.plan = None  # the memory plan (engine.models.memory_plan.MemoryPlan), set by run.commands.prepare
        self.shared = recipe.models.runtime == "shared_backbone"
        self._student = None
        self._teacher = None
        s, t = recipe.models.student, recipe.models.teacher
        self.student_dir: Path = locate_model("student", s.id, s.revision, s.path)
        self.teacher_dir: Path = locate_model("teacher", t.id, t.revision, t.path)
        # The checks `miniverl run --dry-run` collects; here the first refusal raises, before any weight loads.
        dirs = {"student": self.student_dir, "teacher": self.teacher_dir}
        checked = check_models(recipe, dirs, Refusals(collect=False))
        self.configs = checked.configs  # role -> config.json, for the memory plan
        self.teacher_adapter: TeacherAdapter | None = checked.teacher_adapter
        self.pairing: Pairing = checked.pairing  # tokenizer byte-identity and vocabulary rows, already required
        self.tokenizer = checked.tokenizer  # the student's; the checks loaded it to count its tokens

    def use_memory_strategy(self, strategy: str) -> None:
        """The strategy the memory plan chose; only before a model is loaded."""
        if self._student is not None or self._teacher is not None:
            raise RuntimeError("the memory strategy is fixed once a model is loaded")
        self.swap = strategy == "swap" and self.device != "cpu"

    @property
    def vocab_limit(self) -> int:
        return len(self.tokenizer)

    def _student_model(self) -> torch.nn.Module:
        if self._student is None:
            spec = self.recipe.models.student
            base = load_causal_lm(self.student_dir, self.dtype, self.device, nf4=spec.quantization == "nf4")
            self._student = attach_lora(base, spec.lora, derive_seed(self.recipe.seed, 0, "lora-init"))
        return self._student

    def student(self, adapter_state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
        """The student with the given adapter weights loaded (on the compute device)."""
        student = self._student_model()
        self._place(student, self._teacher_module())
        if adapter_state is not None:
            load_adapter_state(student, adapter_state)
        return student

    def teacher(self):
        """The frozen teacher: a model, or for shared_backbone a view of the base with the teacher adapter."""
        if self.shared:
            student = self._student_model()
            if self._teacher is None:
                load_teacher_adapter(student, self.teacher_adapter)
                self._teacher = AdapterView(student, TEACHER_ADAPTER)
            return self._teacher
        if self._teacher is None:
            self._teacher = load_causal_lm(self.teacher_dir, self.dtype, self.device)
        self._place(self._teacher, self._student)
        return self._teacher

    def teacher_head(self) -> torch.Tensor:
        """The teacher's LM head weight [V, H] on the compute device, for stages that need only the head.

        Under `swap` the teacher's body stays in pinned host memory and only its
        head (tied to its embedding in Qwen3) comes back to the device.
        """
        if self.shared or not self.swap:
            return decoder_and_head(self.teacher())[1]
        if self._teacher is None:  # first use in this process: load it, then park all but the head
            self._teacher = load_causal_lm(self.teacher_dir, self.dtype, self.device)
        head = decoder_and_head(self._teacher)[1]
        parked = self._weights(self._teacher)
        parked.release(keep=(head,))
        parked.restore(only=(head,))
        return head

    def initial_adapter(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in adapter_parameters(self.student()).items()}

    def _teacher_module(self) -> torch.nn.Module | None:
        return None if self.shared else self._teacher

    def _weights(self, model: torch.nn.Module) -> PinnedWeights:
        if id(model) not in self._parked:
            self._parked[id(model)] = PinnedWeights(model, self.device)
        return self._parked[id(model)]

    def _place(self, wanted: torch.nn.Module, other: torch.nn.Module | None) -> None:
        """Swap strategy: the model in use gets its weights back, an unquantized other one parks its own."""
        if not self.swap:
            return
        if other is not None and not is_quantized(other):
            self._weights(other).release()
        if not is_quantized(wanted) and id(wanted) in self._parked:
            self._parked[id(wanted)].restore()
