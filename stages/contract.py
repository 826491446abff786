"""What every stage shares: the context it runs in and the outputs it hands back.

A stage module has a `NAME` (a stage id of the layout), and two functions:

- `inputs(key, recipe)` names what it reads, as layout references (producer
  stage, path, type). The driver reads them, checking each file against the
  hash its producer's journal entry recorded, and passes them in by name.
- `outputs(key, recipe)` names what it writes.
- `run(ctx, inputs)` does the stage's one job and returns its outputs, encoded
  but not written: the driver writes them atomically, in order, and journals
  their hashes. A stage never touches the run directory. An output may carry
  a summary (a few figures) that the journal keeps with the stage's record.

This module is not a stage; stages import it and never each other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Mapping, Protocol

import msgspec
import torch

from miniverl.engine.core import layout
from miniverl.engine.core.artifacts import Checkpoint, TensorFile, encode_artifact, encode_tensors
from miniverl.engine.core.atomic_io import sha256_bytes
from miniverl.engine.core.layout import Ref, StageKey
from miniverl.engine.core.progress import Reporter
from miniverl.engine.core.recipe import Recipe
from miniverl.engine.core.rundir import StageRecord
from miniverl.engine.models.host import ModelHost
from miniverl.engine.tasks.base import Task


@dataclass(frozen=True)
class StageContext:
    key: StageKey
    recipe: Recipe
    host: ModelHost
    task: Task
    reporter: Reporter
    run_id: str
    digests: Mapping[str, str]  # input name -> sha256 of the file read (what the journal recorded)
    stage_records: Mapping[str, StageRecord]  # the journal as it stands (the manifest summarises it)
    on_oom_retry: Callable[[int, int, str | None], None]  # (old chunk, new chunk, error)
    overrides: tuple[str, ...] = ()  # the command-line overrides the run's recipe.yaml was made with


@dataclass(frozen=True)
class Output:
    ref: Ref
    data: bytes
    # Headline figures the journal keeps with the stage's record, so the manifest, the console and the
    # report still have them after the retention policy removes the file.
    summary: dict[str, Any] | None = None

    @cached_property
    def sha256(self) -> str:  # read by the record that names the file and by the writer: hashed once
        return sha256_bytes(self.data)


class Stage(Protocol):
    NAME: str

    def inputs(self, key: StageKey, recipe: Recipe) -> dict[str, Ref]: ...

    def outputs(self, key: StageKey, recipe: Recipe) -> list[Ref]: ...

    def run(self, ctx: StageContext, inputs: dict[str, Any]) -> list[Output]: ...


def artifact_output(ref: Ref, value: msgspec.Struct, summary: msgspec.Struct | None = None) -> Output:
    assert isinstance(value, ref.kind), f"{ref.path} holds a {ref.kind.__name__}, not a {type(value).__name__}"
    return Output(ref, encode_artifact(value), None if summary is None else msgspec.to_builtins(summary))


def tensor_output(ref: Ref, tensors: dict[str, torch.Tensor]) -> tuple[Output, TensorFile]:
    """The encoded file and the reference an artifact keeps to it."""
    out = Output(ref, encode_tensors(tensors))
    return out, TensorFile(ref.path, out.sha256)


def json_output(ref: Ref, document: Any) -> Output:
    return Output(ref, json.dumps(document, indent=2, sort_keys=True).encode())


def checkpoint_outputs(step: int, recipe: Recipe, base_config_sha256: str, adapter: dict[str, torch.Tensor],
                       optimizer_tensors: dict[str, torch.Tensor], optimizer_scalars: dict[str, float]) -> list[Output]:
    """Policy checkpoint `step`: adapter, optimizer state (none before the first step), and the record naming both."""
    adapter_out, adapter_file = tensor_output(layout.adapter_ref(step), adapter)
    outputs = [adapter_out]
    optimizer_file = None
    if optimizer_tensors:
        optimizer_out, optimizer_file = tensor_output(layout.optimizer_ref(step), optimizer_tensors)
        outputs.append(optimizer_out)
    student = recipe.models.student
    checkpoint = Checkpoint(
        step=step, adapter=adapter_file, optimizer=optimizer_file, optimizer_scalars=optimizer_scalars,
        adapter_sha256=adapter_file.sha256, base_id=student.id, base_revision=student.revision,
        base_config_sha256=base_config_sha256, lora=msgspec.to_builtins(student.lora),
    )
    return outputs + [artifact_output(layout.checkpoint_ref(step), checkpoint)]


def checkpoint_inputs(step: int) -> dict[str, Ref]:
    return {"checkpoint": layout.checkpoint_ref(step), "adapter": layout.adapter_ref(step)}


def checkpoint_refs(step: int) -> list[Ref]:
    return [layout.adapter_ref(step), layout.optimizer_ref(step), layout.checkpoint_ref(step)]
