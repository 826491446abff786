"""The JSON Schema of a hardware result (`miniverl export-benchmark`).

This dict is the source; `benchmarks/hardware_result.schema.json` is its
published copy, regenerated with
`python -m miniverl.engine.report.benchmark_schema > benchmarks/hardware_result.schema.json`
(a test keeps the two equal). It uses only the keywords engine.json_schema knows.
"""

from __future__ import annotations

import json

FORMAT = "miniverl-hardware-result"
FORMAT_VERSION = 1


def _obj(properties: dict, required: list[str] | None = None, extra: bool | dict = False) -> dict:
    return {"type": "object", "required": list(properties) if required is None else required,
            "properties": properties, "additionalProperties": extra}


STRING = {"type": "string"}
NULLABLE_STRING = {"type": ["string", "null"]}
COUNT = {"type": "integer", "minimum": 0}
SECONDS = {"type": "number", "minimum": 0}
RATE = {"type": "number", "minimum": 0}

VERIFY = _obj({"tasks": COUNT, "tool_call_rate": RATE, "format_validity": RATE, "strict_success": RATE})

SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "miniverl hardware result",
    "description": "One complete miniverl run on one machine: configuration, provenance, measurements, notes.",
    **_obj({
        "format": {"type": "string", "enum": [FORMAT]},
        "format_version": {"type": "integer", "enum": [FORMAT_VERSION]},
        "miniverl_version": STRING,
        "exported_at": STRING,
        "run_id": STRING,
        "notes": STRING,
        "configuration": _obj({
            "recipe": {"type": "object"},
            "resolved": {"type": "object", "additionalProperties": _obj({"value": STRING, "reason": STRING})},
        }),
        "provenance": _obj({
            "device": {"type": "string", "enum": ["cpu", "cuda"]},
            "gpu": NULLABLE_STRING,
            "vram_gib": {"type": ["number", "null"], "minimum": 0},
            "compute_capability": NULLABLE_STRING,
            "driver": NULLABLE_STRING,
            "python": STRING,
            "platform": STRING,
            "torch": STRING,
            "cuda_build": NULLABLE_STRING,
            "libraries": {"type": "object", "additionalProperties": STRING},
            "models": {"type": "array", "items": _obj({
                "role": {"type": "string", "enum": ["student", "teacher"]},
                "id": STRING,
                "revision": NULLABLE_STRING,
                "config_sha256": STRING,
                "architecture": STRING,
                "num_parameters": COUNT,
            })},
            "tokenizer_sha256": STRING,
        }),
        "measurements": _obj({
            "wall_seconds": SECONDS,
            "peak_memory_bytes": COUNT,
            "peak_memory_kind": {"type": "string", "enum": ["cuda_max_allocated", "cpu_max_rss"]},
            "stages": {"type": "array", "items": _obj({
                "stage": STRING, "seconds": SECONDS, "peak_memory_bytes": COUNT, "attempts": {"type": "integer", "minimum": 1},
            })},
            "stage_totals": {"type": "object", "additionalProperties": _obj({
                "seconds": SECONDS, "peak_memory_bytes": COUNT, "count": COUNT,
            })},
            "rollout": _obj({
                "generated_tokens": COUNT, "seconds": SECONDS, "tokens_per_second": {"type": ["number", "null"], "minimum": 0},
            }),
            "oom_retries": COUNT,
            "chunk_sizes_used": {"type": "array", "items": {"type": "integer", "minimum": 1}},
            "cycles": {"type": "array", "items": _obj({
                "cycle": COUNT, "loss": {"type": ["number", "null"]}, "kl": {"type": ["number", "null"]}, "tool_call_rate": RATE,
                "generated_tokens": COUNT, "tokens_per_second": {"type": ["number", "null"], "minimum": 0},
            })},
        }),
        "verifier": _obj({
            "baseline": VERIFY,
            "final": VERIFY,
            "quality_gate": _obj({"passed": {"type": "boolean"}, "reason": STRING}),
        }),
    }),
}


if __name__ == "__main__":
    print(json.dumps(SCHEMA, indent=2))
