"""`miniverl export-benchmark` and `miniverl validate-benchmark`: a run as a shareable hardware result.

The document carries everything needed to judge a number: the full resolved
configuration, provenance (device, driver, torch, CUDA and library versions,
model revisions and config hashes, tokenizer hash), what was measured
(per-stage seconds and peak memory, rollout throughput, OOM retries, loss and
KL per cycle, the verifier before and after) and the submitter's notes. Its
types are the Structs of engine.report.benchmark_schema, whose JSON Schema a
document is checked against before it is written; `validate-benchmark` checks
one received from anyone.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from miniverl.engine.core.errors import MiniverlError, RunStateError, UserError
from miniverl.engine.report.benchmark_schema import FORMAT, FORMAT_VERSION, problems

if TYPE_CHECKING:  # both import torch, which validate-benchmark does without
    from miniverl.engine.core.artifacts import Manifest
    from miniverl.engine.report.summary import RunSummary

LIBRARIES = ("transformers", "peft", "bitsandbytes", "tokenizers", "safetensors", "msgspec")


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _version() -> str:
    from miniverl.engine.core.device import package_version  # here, not at the top: validate-benchmark needs no torch

    return package_version("miniverl") or "unknown"


def _provenance(manifest: Manifest) -> dict[str, Any]:
    env = manifest.environment
    driver = env.get("driver")
    return {
        "device": manifest.resolved["device"].value,
        "gpu": env.get("gpu"),
        "vram_gib": float(env["gpu_memory_gib"]) if "gpu_memory_gib" in env else None,
        "compute_capability": env.get("compute_capability"),
        "driver": None if driver in (None, "none") else driver,
        "python": env["python"],
        "platform": env["platform"],
        "torch": env["torch"],
        "cuda_build": None if env.get("cuda_build") in (None, "None") else env["cuda_build"],
        "libraries": {name: env[name] for name in LIBRARIES if name in env},
        "models": [{"role": m.role, "id": m.id, "revision": m.revision, "config_sha256": m.config_sha256,
                    "architecture": m.architecture, "num_parameters": m.num_parameters} for m in manifest.models],
        "tokenizer_sha256": manifest.tokenizer.student_sha256,
    }


def _measurements(summary: RunSummary, device: str) -> dict[str, Any]:
    from miniverl.engine.report.summary import stage_totals

    done = [s for s in summary.stages if s.state == "done"]
    tokens = sum(c.generated_tokens or 0 for c in summary.cycles)
    seconds = sum(c.rollout_seconds or 0.0 for c in summary.cycles)
    return {
        "wall_seconds": summary.row.wall_seconds or 0.0,
        "peak_memory_bytes": max((s.peak_memory_bytes or 0 for s in done), default=0),
        "peak_memory_kind": "cuda_max_allocated" if device == "cuda" else "cpu_max_rss",
        "stages": [{"stage": s.stage, "seconds": s.seconds or 0.0, "peak_memory_bytes": s.peak_memory_bytes or 0,
                    "attempts": max(s.attempts, 1)} for s in done],
        "stage_totals": stage_totals(done),
        "rollout": {"generated_tokens": tokens, "seconds": seconds,
                    "tokens_per_second": tokens / seconds if seconds > 0 else None},
        "oom_retries": sum(c.oom_retries for c in summary.cycles),
        "chunk_sizes_used": sorted({c.chunk_size for c in summary.cycles if c.chunk_size}),
        "cycles": [{"cycle": c.cycle, "loss": _finite(c.loss), "kl": _finite(c.kl), "tool_call_rate": c.tool_call_rate or 0.0,
                    "generated_tokens": c.generated_tokens or 0, "tokens_per_second": c.tokens_per_second}
                   for c in summary.cycles],
    }


def build(summary: RunSummary, notes: str) -> dict[str, Any]:
    manifest = summary.manifest
    if manifest is None or summary.row.status != "done":
        raise RunStateError(f"run {summary.row.run_id} has status {summary.row.status}: a hardware result needs a finished run "
                            f"with a manifest; finish it with `miniverl resume {summary.row.run_id}`")
    from miniverl.engine.core.layout import BASELINE, FINAL

    verify = {label: {"tasks": v.tasks, "tool_call_rate": v.tool_call_rate, "format_validity": v.format_validity,
                      "strict_success": v.strict_success}
              for label, v in ((BASELINE, manifest.verify_baseline), (FINAL, manifest.verify))}
    device = manifest.resolved["device"].value
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "miniverl_version": _version(),
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "run_id": summary.row.run_id,
        "notes": notes,
        "configuration": {"recipe": manifest.recipe, "resolved": msgspec.to_builtins(manifest.resolved)},
        "provenance": _provenance(manifest),
        "measurements": _measurements(summary, device),
        "verifier": {**verify, "quality_gate": {"passed": manifest.quality_gate.passed,
                                                "reason": manifest.quality_gate.reason}},
    }


def export(run_id: str, runs_dir: Path, notes: str, out: Path | None) -> Path:
    from miniverl.engine.core.atomic_io import write_bytes_atomic
    from miniverl.engine.report.summary import summarize
    from miniverl.engine.run.commands import open_run

    run, recipe = open_run(run_id, runs_dir)
    document = build(summarize(run, recipe), notes)
    broken = problems(document)
    if broken:  # our own output must conform; a failure here is a miniverl bug
        raise MiniverlError(f"the exported document breaks its own schema: {broken[0]}")
    path = out or run.root / "hardware_result.json"
    write_bytes_atomic(path, (json.dumps(document, indent=2, sort_keys=True, allow_nan=False) + "\n").encode())
    return path


def load_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{what} {path} cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{what} {path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None


def check_file(path: Path, schema_path: Path | None = None) -> list[str]:
    """Every way the document at `path` breaks the hardware-result schema (or `schema_path`)."""
    schema = None if schema_path is None else load_json(schema_path, "schema")
    document = load_json(path, "hardware result")
    return problems(document, schema, source=f"schema {schema_path}")
