"""Typed artifacts: the only channel between stages.

Every artifact is a msgspec Struct encoded with msgpack inside an `Envelope`
that carries the schema version, the artifact kind and the sha256 of the
payload, so a reader detects truncation, bit flips and stale schemas before
trusting anything. Large tensors go to safetensors files that an artifact
names together with their sha256.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import msgspec
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from miniverl.engine.core.atomic_io import sha256_bytes
from miniverl.engine.core.errors import ArtifactError

SCHEMA_VERSION = 1

PROVENANCE_PROMPT = 0
PROVENANCE_MODEL = 1
PROVENANCE_TOOL = 2


class Envelope(msgspec.Struct, frozen=True):
    schema: int
    kind: str
    payload_sha256: str
    payload: bytes


class TensorFile(msgspec.Struct, frozen=True):
    """A safetensors file, relative to the run directory, with its hash."""

    path: str
    sha256: str


# ---------------------------------------------------------------- preflight
class ModelIdentity(msgspec.Struct, frozen=True):
    role: str
    id: str
    revision: str | None
    local_dir: str
    config_sha256: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_parameters: int


class TokenizerVerdict(msgspec.Struct, frozen=True):
    compatible: bool
    student_sha256: str
    teacher_sha256: str
    tokenizer_size: int
    student_vocab_rows: int
    teacher_vocab_rows: int
    padded_rows: int
    reason: str


class Resolution(msgspec.Struct, frozen=True):
    value: str
    reason: str


class TaskIdentity(msgspec.Struct, frozen=True):
    name: str
    train_items: int  # distinct items each split can serve
    heldout_items: int
    files: dict[str, str]  # recipe key -> sha256 of the run's copy


class Preflight(msgspec.Struct, frozen=True):
    recipe: dict[str, Any]
    resolved: dict[str, Resolution]
    environment: dict[str, str]
    models: list[ModelIdentity]
    tokenizer: TokenizerVerdict
    adapter: dict[str, Any]
    task: TaskIdentity
    heldout_task_ids: list[str]


# ---------------------------------------------------------------- checkpoint
class Checkpoint(msgspec.Struct, frozen=True):
    step: int
    adapter: TensorFile
    optimizer: TensorFile | None
    optimizer_scalars: dict[str, float]
    adapter_sha256: str
    base_id: str
    base_revision: str | None
    base_config_sha256: str
    lora: dict[str, Any]


# ---------------------------------------------------------------- rollout
class Trajectory(msgspec.Struct, frozen=True):
    task_id: str
    question: str
    answer: str  # the task's gold answer
    token_ids: list[int]
    provenance: list[int]  # PROVENANCE_* per token
    sampling_logprobs: list[float]  # one per model-generated token, in order
    turns: list[str]
    tool_results: list[str]  # every tool response, in call order
    tool_ok: list[bool]
    finish_reason: str  # stop | length | max_turns
    tool_called: bool
    format_valid: bool
    strict_success: bool

    @property
    def model_positions(self) -> list[int]:
        return [i for i, p in enumerate(self.provenance) if p == PROVENANCE_MODEL]


class Rollout(msgspec.Struct, frozen=True):
    cycle: int
    policy_adapter_sha256: str
    temperature: float
    top_p: float
    trajectories: list[Trajectory]
    generated_tokens: int


class RolloutSummary(msgspec.Struct, frozen=True):
    """A rollout's figures, kept in the journal after the rollout file itself may be pruned."""

    trajectories: int
    tool_call_rate: float
    rollout_success: float
    generated_tokens: int

    @staticmethod
    def of(rollout: Rollout) -> "RolloutSummary":
        n = max(len(rollout.trajectories), 1)
        return RolloutSummary(len(rollout.trajectories), sum(t.tool_called for t in rollout.trajectories) / n,
                              sum(t.strict_success for t in rollout.trajectories) / n, rollout.generated_tokens)


# ---------------------------------------------------------------- teacher score
class TeacherScore(msgspec.Struct, frozen=True):
    cycle: int
    mode: str
    rollout_sha256: str
    positions: list[int]  # model-generated positions per trajectory
    tensors: TensorFile  # sampled_kl: teacher_logprobs; topk_tail: topk_ids/topk_logprobs; exact: teacher_hidden


# ---------------------------------------------------------------- gradient
class ChunkAttempt(msgspec.Struct, frozen=True):
    chunk_size: int
    ok: bool
    error: str | None


class Gradient(msgspec.Struct, frozen=True):
    cycle: int
    policy_adapter_sha256: str
    tensors: TensorFile
    loss: float
    kl: float
    positions: int
    micro_batches: int
    chunk_size: int
    attempts: list[ChunkAttempt]
    grad_norm: float


# ---------------------------------------------------------------- verify
class VerifyItem(msgspec.Struct, frozen=True):
    task_id: str
    question: str
    turns: list[str]
    tool_called: bool
    format_valid: bool
    strict_success: bool
    checks: dict[str, bool]  # every check the task's judge reports, in its order (strict success: all of them)


class VerifyReport(msgspec.Struct, frozen=True):
    label: str
    policy_adapter_sha256: str
    tasks: int
    tool_call_rate: float
    format_validity: float
    strict_success: float
    items: list[VerifyItem]


# ---------------------------------------------------------------- manifest (manifest.json)
class CycleSummary(msgspec.Struct, frozen=True):
    cycle: int
    loss: float
    kl: float
    positions: int
    grad_norm: float
    chunk_size: int
    micro_batches: int
    attempts: list[ChunkAttempt]

    @staticmethod
    def of(g: Gradient) -> "CycleSummary":
        return CycleSummary(g.cycle, g.loss, g.kl, g.positions, g.grad_norm, g.chunk_size, g.micro_batches, g.attempts)


class VerifySummary(msgspec.Struct, frozen=True):
    tasks: int
    tool_call_rate: float
    format_validity: float
    strict_success: float
    policy_adapter_sha256: str


class QualityGate(msgspec.Struct, frozen=True):
    passed: bool
    checks: dict[str, bool]
    min_tool_call_rate: float
    reason: str


class StageSummary(msgspec.Struct, frozen=True):
    seconds: float | None
    peak_memory_bytes: int | None
    attempts: int


class Manifest(msgspec.Struct, frozen=True):
    """The terminal document: what ran, on what, with which result. JSON, for people and tools."""

    manifest_version: int
    status: str
    run_id: str
    recipe: dict[str, Any]
    resolved: dict[str, Resolution]
    environment: dict[str, str]
    models: list[ModelIdentity]
    tokenizer: TokenizerVerdict
    adapter: dict[str, Any]
    adapter_sha256: str
    cycles: list[CycleSummary]
    oom_retries: int
    chunk_sizes_used: list[int]
    verify: VerifySummary
    verify_baseline: VerifySummary
    quality_gate: QualityGate
    stages: dict[str, StageSummary]
    overrides: list[str] = msgspec.field(default_factory=list)  # command-line `key=value` items the recipe got


def decode_manifest(data: bytes) -> Manifest:
    return msgspec.json.decode(data, type=Manifest)


T = TypeVar("T")
_encoder = msgspec.msgpack.Encoder()


def encode_artifact(value: msgspec.Struct) -> bytes:
    payload = _encoder.encode(value)
    envelope = Envelope(SCHEMA_VERSION, type(value).__name__, sha256_bytes(payload), payload)
    return _encoder.encode(envelope)


def decode_artifact(data: bytes, kind: type[T], source: str) -> T:
    try:
        envelope = msgspec.msgpack.decode(data, type=Envelope)
    except msgspec.DecodeError as exc:
        raise ArtifactError(f"{source}: unreadable artifact ({exc})") from None
    if envelope.schema != SCHEMA_VERSION:
        raise ArtifactError(f"{source}: schema {envelope.schema}, this miniverl reads {SCHEMA_VERSION}")
    if envelope.kind != kind.__name__:
        raise ArtifactError(f"{source}: holds a {envelope.kind}, expected {kind.__name__}")
    if sha256_bytes(envelope.payload) != envelope.payload_sha256:
        raise ArtifactError(f"{source}: content hash mismatch (the file is corrupt)")
    try:
        return msgspec.msgpack.decode(envelope.payload, type=kind)
    except msgspec.DecodeError as exc:
        raise ArtifactError(f"{source}: payload does not match {kind.__name__} ({exc})") from None


def read_artifact(path: Path, kind: type[T], expected_sha256: str | None = None) -> T:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"{path}: missing") from None
    if expected_sha256 is not None and sha256_bytes(data) != expected_sha256:
        raise ArtifactError(f"{path}: does not match the hash the journal recorded (corrupt or replaced)")
    return decode_artifact(data, kind, str(path))


def encode_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    return st_save({name: t.detach().contiguous().cpu() for name, t in tensors.items()})


def decode_tensors(data: bytes, expected_sha256: str | None, source: str) -> dict[str, torch.Tensor]:
    """The tensors in safetensors bytes that hash to `expected_sha256` (None: bytes known to be intact)."""
    if expected_sha256 is not None and sha256_bytes(data) != expected_sha256:
        raise ArtifactError(f"{source}: content hash mismatch (the file is corrupt)")
    return st_load(data)


def read_tensors_file(path: Path, expected_sha256: str | None) -> dict[str, torch.Tensor]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"{path}: missing") from None
    return decode_tensors(data, expected_sha256, str(path))


def read_tensors(run_dir: Path, ref: TensorFile) -> dict[str, torch.Tensor]:
    return read_tensors_file(run_dir / ref.path, ref.sha256)
