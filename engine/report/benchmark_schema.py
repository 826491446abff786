"""The hardware-result document (`miniverl export-benchmark`) as msgspec Structs, and its JSON Schema.

The Structs are the source. `benchmarks/hardware_result.schema.json` is the
JSON Schema msgspec generates from them, published for anyone who checks a
result without miniverl; regenerate it with

    python -m miniverl.engine.report.benchmark_schema > benchmarks/hardware_result.schema.json

(a test keeps the two equal). Every field is required and no other field is
allowed, so a document either carries the whole record or is refused.
"""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from miniverl.engine.core import schema_check

if TYPE_CHECKING:
    from jsonschema.protocols import Validator

FORMAT = "miniverl-hardware-result"
FORMAT_VERSION = 1

Count = Annotated[int, msgspec.Meta(ge=0)]
AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]
Rate = Annotated[float, msgspec.Meta(ge=0)]  # a fraction of tasks or trajectories
Throughput = Annotated[float, msgspec.Meta(ge=0)]  # tokens per second


class _Record(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ResolvedValue(_Record):
    value: str
    reason: str


class Configuration(_Record):
    recipe: dict[str, Any]  # the recipe as the run decoded it, every default filled in
    resolved: dict[str, ResolvedValue]  # each `auto` recipe key -> its value on that machine and why


class ModelIdentity(_Record):
    role: Literal["student", "teacher"]
    id: str
    revision: str | None
    config_sha256: str
    architecture: str
    num_parameters: Count


class Provenance(_Record):
    device: Literal["cpu", "cuda"]
    gpu: str | None
    vram_gib: Annotated[float, msgspec.Meta(ge=0)] | None
    compute_capability: str | None
    driver: str | None
    python: str
    platform: str
    torch: str
    cuda_build: str | None
    libraries: dict[str, str]  # library name -> version
    models: list[ModelIdentity]
    tokenizer_sha256: str


class StageMeasurement(_Record):
    stage: str
    seconds: Seconds
    peak_memory_bytes: Count
    attempts: AtLeastOne


class StageTotal(_Record):
    seconds: Seconds
    peak_memory_bytes: Count
    count: Count


class RolloutThroughput(_Record):
    generated_tokens: Count
    seconds: Seconds
    tokens_per_second: Throughput | None  # null when no rollout time was measured


class CycleMeasurement(_Record):
    cycle: Count
    loss: float | None  # null when not finite
    kl: float | None
    tool_call_rate: Rate
    generated_tokens: Count
    tokens_per_second: Throughput | None


class Measurements(_Record):
    wall_seconds: Seconds
    peak_memory_bytes: Count
    peak_memory_kind: Literal["cuda_max_allocated", "cpu_max_rss"]
    stages: list[StageMeasurement]
    stage_totals: dict[str, StageTotal]  # stage name, cycles folded together
    rollout: RolloutThroughput
    oom_retries: Count
    chunk_sizes_used: list[AtLeastOne]
    cycles: list[CycleMeasurement]


class VerifierResult(_Record):
    tasks: Count
    tool_call_rate: Rate
    format_validity: Rate
    strict_success: Rate


class QualityGate(_Record):
    passed: bool
    reason: str


class Verifier(_Record):
    baseline: VerifierResult
    final: VerifierResult
    quality_gate: QualityGate


class HardwareResult(_Record):
    """One complete miniverl run on one machine: configuration, provenance, measurements, notes."""

    format: Literal["miniverl-hardware-result"]
    format_version: Literal[1]
    miniverl_version: str
    exported_at: str
    run_id: str
    notes: str
    configuration: Configuration
    provenance: Provenance
    measurements: Measurements
    verifier: Verifier


def schema() -> dict[str, Any]:
    """The published JSON Schema: msgspec's, with the draft it follows and a title."""
    return {"$schema": schema_check.DRAFT, "title": "miniverl hardware result", **msgspec.json.schema(HardwareResult)}


@functools.cache
def _builtin_validator() -> Validator:
    return schema_check.strict_validator(schema(), source="the hardware-result schema")


_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def json_path(path: schema_check.KeyPath) -> str:
    """`('measurements', 'stages', 0, 'seconds')` -> `$.measurements.stages[0].seconds`; odd keys in brackets."""
    parts = ["$"]
    for key in path:
        if isinstance(key, int):
            parts.append(f"[{key}]")
        else:
            parts.append(f".{key}" if _IDENTIFIER.match(str(key)) else f"[{json.dumps(str(key))}]")
    return "".join(parts)


def problems(document: Any, schema: Any = None, source: str = "schema") -> list[str]:
    """Every way `document` breaks the hardware-result schema (or `schema`), one `$.path: problem` line each."""
    validator = _builtin_validator() if schema is None else schema_check.strict_validator(schema, source)
    lines = []
    for problem in schema_check.problems(validator, document):
        what = {"missing": "required field is missing",
                "unknown": "unexpected field (the schema does not define it)"}.get(problem.kind, problem.detail)
        lines.append(f"{json_path(problem.path)}: {what}")
    return lines


if __name__ == "__main__":
    print(json.dumps(schema(), indent=2))
