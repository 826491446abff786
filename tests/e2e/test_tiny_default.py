"""The embedded default learns the skill; the negative control does not (the real command, end to end)."""

from __future__ import annotations

import time

import pytest

from support import ROOT, manifest, miniverl


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tiny_calc.yaml", "tiny_sql.yaml", "tiny_jsonl_example.yaml"])
def test_tiny_default_learns_the_tool(tmp_path, recipe):
    started = time.perf_counter()
    result = miniverl("run", str(ROOT / "recipes" / recipe), "--run-id", "tiny", "--runs-dir", str(tmp_path))
    seconds = time.perf_counter() - started
    assert result.returncode == 0, result.stderr[-3000:]
    document = manifest(tmp_path, "tiny")
    assert document["status"] == "completed"
    assert document["verify_baseline"]["strict_success"] <= 0.05
    assert document["verify"]["strict_success"] >= 0.90
    assert document["verify"]["tool_call_rate"] >= 0.90
    assert document["quality_gate"]["passed"] is True
    assert len(document["adapter_sha256"]) == 64
    assert [c["cycle"] for c in document["cycles"]] == list(range(document["recipe"]["train"]["cycles"]))
    assert "quality gate passed" in result.stdout
    # The spec's bar is 3 minutes on two cores; leave headroom for a loaded CI machine.
    assert seconds < 300, seconds


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tiny_calc_raw_teacher.yaml", "tiny_sql_raw_teacher.yaml"])
def test_negative_control_completes_but_fails_the_gate(tmp_path, recipe):
    result = miniverl("run", str(ROOT / "recipes" / recipe), "--run-id", "raw", "--runs-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]  # the run itself completed
    document = manifest(tmp_path, "raw")
    assert document["verify"]["tool_call_rate"] <= 0.05
    assert document["quality_gate"]["passed"] is False
    assert document["quality_gate"]["checks"]["student_calls_the_tool"] is False
    assert "quality gate FAILED" in result.stdout
    # Its loss fell all the same: a falling loss is not evidence of the skill.
    losses = [c["loss"] for c in document["cycles"]]
    assert losses[-1] < losses[0]
