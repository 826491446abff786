"""Manifest: one document that says what ran, on what, with which result.

The quality gate is deliberately independent of the loss: a student that
never calls the tool fails it however well the KL fell (the negative control
exists to show exactly that).
"""

from __future__ import annotations

from typing import Any

import msgspec

MANIFEST_VERSION = 1


def quality_gate(recipe, baseline, final) -> dict[str, Any]:
    checks = {
        "student_calls_the_tool": final.tool_call_rate >= recipe.verify.min_tool_call_rate,
        "strict_success_improved": final.strict_success > baseline.strict_success,
    }
    failed = [name for name, ok in checks.items() if not ok]
    return {
        "passed": not failed,
        "checks": checks,
        "min_tool_call_rate": recipe.verify.min_tool_call_rate,
        "reason": "all checks passed" if not failed else "failed: " + ", ".join(failed),
    }


def _verify_summary(report) -> dict[str, Any]:
    return {
        "tasks": report.tasks,
        "tool_call_rate": report.tool_call_rate,
        "format_validity": report.format_validity,
        "strict_success": report.strict_success,
        "policy_adapter_sha256": report.policy_adapter_sha256,
    }


def build(pipeline) -> dict[str, Any]:
    """Assemble the manifest from the journal and the artifacts the pipeline can read."""
    recipe = pipeline.recipe
    pre = pipeline.preflight_artifact()
    baseline, final = pipeline.verify_report("baseline"), pipeline.verify_report("final")
    grads = pipeline.gradients()
    checkpoint, _ = pipeline.policy(recipe.train.cycles)
    stages = {
        key: {"seconds": rec.seconds, "peak_memory_bytes": rec.peak_memory_bytes, "attempts": rec.attempts}
        for key, rec in pipeline.stage_records().items() if rec.state == "done"
    }
    return {
        "manifest_version": MANIFEST_VERSION,
        "status": "completed",
        "run_id": pipeline.run.root.name,
        "recipe": pre.recipe,
        "resolved": msgspec.to_builtins(pre.resolved),
        "environment": pre.environment,
        "models": msgspec.to_builtins(pre.models),
        "tokenizer": msgspec.to_builtins(pre.tokenizer),
        "adapter": pre.adapter,
        "adapter_sha256": checkpoint.adapter_sha256,
        "cycles": [
            {"cycle": g.cycle, "loss": g.loss, "kl": g.kl, "positions": g.positions, "grad_norm": g.grad_norm,
             "chunk_size": g.chunk_size, "micro_batches": g.micro_batches,
             "attempts": msgspec.to_builtins(g.attempts)}
            for g in grads
        ],
        "oom_retries": sum(1 for g in grads for a in g.attempts if not a.ok),
        "chunk_sizes_used": sorted({g.chunk_size for g in grads}),
        "verify": _verify_summary(final),
        "verify_baseline": _verify_summary(baseline),
        "quality_gate": quality_gate(recipe, baseline, final),
        "stages": stages,
    }
