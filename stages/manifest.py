"""Manifest: one document that says what ran, on what, with which result.

reads preflight, both verifier reports and the final checkpoint, and the
journal's stage records (each cycle's figures are the summary its gradient
stage left there, which outlives the gradient file); writes manifest.json.

The quality gate is deliberately independent of the loss: a student that
never calls the tool fails it however well the KL fell (the negative control
exists to show exactly that).
"""

from __future__ import annotations

from typing import Mapping

import msgspec

from miniverl.engine.core import layout
from miniverl.engine.core.artifacts import (
    CycleSummary, Manifest, QualityGate, StageSummary, VerifyReport, VerifySummary,
)
from miniverl.engine.core.layout import Ref, StageKey
from miniverl.engine.core.recipe import Recipe
from miniverl.engine.core.rundir import StageRecord
from miniverl.stages.contract import Output, StageContext, json_output

NAME = layout.MANIFEST
MANIFEST_VERSION = 1


def quality_gate(recipe: Recipe, baseline: VerifyReport, final: VerifyReport) -> QualityGate:
    checks = {
        "student_calls_the_tool": final.tool_call_rate >= recipe.verify.min_tool_call_rate,
        "strict_success_improved": final.strict_success > baseline.strict_success,
    }
    failed = [name for name, ok in checks.items() if not ok]
    return QualityGate(passed=not failed, checks=checks, min_tool_call_rate=recipe.verify.min_tool_call_rate,
                       reason="all checks passed" if not failed else "failed: " + ", ".join(failed))


def _verify_summary(report: VerifyReport) -> VerifySummary:
    return VerifySummary(report.tasks, report.tool_call_rate, report.format_validity, report.strict_success,
                         report.policy_adapter_sha256)


def cycle_summary(records: Mapping[str, StageRecord], cycle: int) -> CycleSummary:
    summary = records[layout.gradient_ref(cycle).producer.id].summary_as(CycleSummary)
    assert summary is not None, f"cycle {cycle}'s gradient left no summary"
    return summary


def inputs(key: StageKey, recipe: Recipe) -> dict[str, Ref]:
    cycles = recipe.train.cycles
    # The final checkpoint is a function of every gradient, so a gradient that changes reaches the manifest.
    return {"preflight": layout.preflight_ref(), "checkpoint": layout.checkpoint_ref(cycles),
            "baseline": layout.verify_ref(layout.BASELINE), "final": layout.verify_ref(layout.FINAL)}


def outputs(key: StageKey, recipe: Recipe) -> list[Ref]:
    return [layout.manifest_ref()]


def build(ctx: StageContext, got: dict) -> Manifest:
    recipe, pre = ctx.recipe, got["preflight"]
    baseline, final = got["baseline"], got["final"]
    grads = [cycle_summary(ctx.stage_records, c) for c in range(recipe.train.cycles)]
    return Manifest(
        manifest_version=MANIFEST_VERSION,
        status="completed",
        run_id=ctx.run_id,
        recipe=pre.recipe,
        resolved=pre.resolved,
        environment=pre.environment,
        models=pre.models,
        tokenizer=pre.tokenizer,
        adapter=pre.adapter,
        adapter_sha256=got["checkpoint"].adapter_sha256,
        cycles=grads,
        oom_retries=sum(1 for g in grads for a in g.attempts if not a.ok),
        chunk_sizes_used=sorted({g.chunk_size for g in grads}),
        verify=_verify_summary(final),
        verify_baseline=_verify_summary(baseline),
        quality_gate=quality_gate(recipe, baseline, final),
        stages={key: StageSummary(rec.seconds, rec.peak_memory_bytes, rec.attempts)
                for key, rec in ctx.stage_records.items() if rec.state == "done"},
        overrides=list(ctx.overrides),
    )


def run(ctx: StageContext, got: dict) -> list[Output]:
    return [json_output(layout.manifest_ref(), msgspec.to_builtins(build(ctx, got)))]
