"""The hardware-result schema: generated from the Structs, published unchanged, and every problem named by its path.

A hand-written document stands for what `export-benchmark` writes; each broken
copy of it is judged twice, by the generated JSON Schema (through jsonschema)
and by msgspec decoding the Structs, and the two must agree.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import jsonschema
import msgspec
import pytest

from support import ROOT
from miniverl.engine.core.errors import UserError
from miniverl.engine.report.benchmark import check_file
from miniverl.engine.report.benchmark_schema import FORMAT, FORMAT_VERSION, HardwareResult, problems, schema

PUBLISHED = ROOT / "benchmarks" / "hardware_result.schema.json"

BASELINE = {"tasks": 8, "tool_call_rate": 0.0, "format_validity": 0.75, "strict_success": 0.25}
FINAL = {"tasks": 8, "tool_call_rate": 0.5, "format_validity": 1.0, "strict_success": 0.5}
DOCUMENT = {
    "format": "miniverl-hardware-result",
    "format_version": 1,
    "miniverl_version": "0.1.0",
    "exported_at": "2026-03-01T12:00:00+0000",
    "run_id": "small",
    "notes": "CI CPU",
    "configuration": {
        "recipe": {"name": "tiny_calc", "train": {"cycles": 2}},
        "resolved": {"models.device": {"value": "cpu", "reason": "no CUDA device"}},
    },
    "provenance": {
        "device": "cpu", "gpu": None, "vram_gib": None, "compute_capability": None, "driver": None,
        "python": "3.11.7", "platform": "Linux-x86_64", "torch": "2.13.0+cpu", "cuda_build": None,
        "libraries": {"msgspec": "0.23.0"},
        "models": [{"role": "student", "id": "miniverl-builtin/student_base", "revision": None,
                    "config_sha256": "ab" * 32, "architecture": "Qwen3ForCausalLM", "num_parameters": 348768}],
        "tokenizer_sha256": "cd" * 32,
    },
    "measurements": {
        "wall_seconds": 31.5, "peak_memory_bytes": 2**30, "peak_memory_kind": "cpu_max_rss",
        "stages": [{"stage": "preflight", "seconds": 1.25, "peak_memory_bytes": 2**29, "attempts": 1}],
        "stage_totals": {"preflight": {"seconds": 1.25, "peak_memory_bytes": 2**29, "count": 1}},
        "rollout": {"generated_tokens": 900, "seconds": 3.0, "tokens_per_second": 300.0},
        "oom_retries": 0,
        "chunk_sizes_used": [128],
        "cycles": [{"cycle": 0, "loss": 0.5, "kl": None, "tool_call_rate": 0.25, "generated_tokens": 900,
                    "tokens_per_second": 300.0}],
    },
    "verifier": {"baseline": BASELINE, "final": FINAL, "quality_gate": {"passed": False, "reason": "no improvement"}},
}


DELETE = object()


def _broken(**changes) -> dict:
    """DOCUMENT with `a.b.0.c=value` changes; the value DELETE removes the key."""
    document = copy.deepcopy(DOCUMENT)
    for dotted, value in changes.items():
        *parents, last = [int(k) if k.isdigit() else k for k in dotted.split("__")]
        node = document
        for key in parents:
            node = node[key]
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
    return document


def test_published_file_is_what_the_structs_generate():
    assert json.loads(PUBLISHED.read_text()) == schema()
    # ...and byte for byte what the documented command writes, so regenerating it is a no-op.
    printed = subprocess.run([sys.executable, "-m", "miniverl.engine.report.benchmark_schema"],
                             capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert printed == PUBLISHED.read_text()


def test_schema_is_a_valid_2020_12_schema_with_the_format_constants():
    jsonschema.Draft202012Validator.check_schema(schema())
    properties = schema()["$defs"]["HardwareResult"]["properties"]
    assert properties["format"]["enum"] == [FORMAT] and properties["format_version"]["enum"] == [FORMAT_VERSION]
    assert schema()["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_a_complete_document_conforms():
    assert problems(DOCUMENT) == []
    msgspec.convert(DOCUMENT, HardwareResult, strict=True)  # the Structs read it too


@pytest.mark.parametrize("changes,expected", [
    ({"provenance__torch": DELETE}, ["$.provenance.torch: required field is missing"]),
    ({"provenance__torch": 2}, ["$.provenance.torch: expected string; got integer 2"]),
    ({"measurements__stages__0__seconds": "fast"},
     ["$.measurements.stages[0].seconds: expected number >= 0; got string 'fast'"]),
    ({"measurements__stages__0__attempts": 0}, ["$.measurements.stages[0].attempts: expected integer >= 1; got integer 0"]),
    ({"measurements__oom_retries": 1.0}, ["$.measurements.oom_retries: expected integer >= 0; got number 1.0"]),
    ({"verifier__quality_gate__passed": 1}, ["$.verifier.quality_gate.passed: expected boolean; got integer 1"]),
    ({"provenance__device": "tpu"}, ["$.provenance.device: expected one of 'cpu', 'cuda'; got string 'tpu'"]),
    ({"format_version": 2}, ["$.format_version: expected one of 1; got integer 2"]),
    ({"provenance__vram_gib": "big"}, ["$.provenance.vram_gib: expected number >= 0 or null; got string 'big'"]),
    ({"provenance__vram_gib": -1.0}, ["$.provenance.vram_gib: expected number >= 0; got number -1.0"]),
    ({"provenance__models__0__role": None},
     ["$.provenance.models[0].role: expected one of 'student', 'teacher'; got null"]),
    ({"measurements__stage_totals__a-b": {"seconds": -1.0, "peak_memory_bytes": 0, "count": 0}},
     ['$.measurements.stage_totals["a-b"].seconds: expected number >= 0; got number -1.0']),
    ({"measurements__rollout": []}, ["$.measurements.rollout: expected a mapping; got a list"]),
    ({"gpu": "H200"}, ["$.gpu: unexpected field (the schema does not define it)"]),
    ({"provenance__torch": DELETE, "notes": 3, "verifier__final__tasks": -1, "extra": 1}, [  # in document order
        "$.notes: expected string; got integer 3",
        "$.provenance.torch: required field is missing",
        "$.verifier.final.tasks: expected integer >= 0; got integer -1",
        "$.extra: unexpected field (the schema does not define it)",
    ]),
])
def test_each_problem_is_one_line_named_by_its_path(changes, expected):
    document = _broken(**changes)
    assert problems(document) == expected
    with pytest.raises(msgspec.ValidationError):  # the decoder refuses the same document
        msgspec.convert(document, HardwareResult, strict=True)


def test_nan_is_refused_where_json_has_none():
    """Stricter than msgspec on purpose: JSON has no NaN, and the exporter writes a non-finite loss as null."""
    document = _broken(measurements__cycles__0__loss=float("nan"))
    assert problems(document) == ["$.measurements.cycles[0].loss: expected number or null; got number nan"]
    assert problems(_broken(measurements__cycles__0__loss=None)) == []


def test_another_schema_can_be_given(tmp_path):
    """`--schema FILE`: any JSON Schema, its own draft honoured, the same kind of lines."""
    subset = {"type": "object", "required": ["n", "tags"], "additionalProperties": False, "properties": {
        "n": {"type": "integer", "minimum": 1}, "x": {"type": ["number", "null"]},
        "mode": {"type": "string", "enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "m": {"type": "object", "additionalProperties": {"type": "boolean"}},
    }}
    assert problems({"n": 2, "x": None, "tags": ["t"], "m": {"k": True}}, subset) == []
    assert problems({"n": True, "tags": [], "x": 1}, subset) == ["$.n: expected integer >= 1; got boolean true"]
    assert problems({"n": 0, "tags": ["a", 3], "mode": "c", "zz": 1, "m": {"a-b": 1}}, subset) == [
        "$.n: expected integer >= 1; got integer 0", "$.tags[1]: expected string; got integer 3",
        "$.mode: expected one of 'a', 'b'; got string 'c'", "$.zz: unexpected field (the schema does not define it)",
        '$.m["a-b"]: expected boolean; got integer 1']
    assert problems({}, subset) == ["$.n: required field is missing", "$.tags: required field is missing"]

    document, given = tmp_path / "result.json", tmp_path / "schema.json"
    document.write_text(json.dumps({"n": 0, "tags": []}))
    given.write_text(json.dumps(subset))
    assert check_file(document, given) == ["$.n: expected integer >= 1; got integer 0"]
    given.write_text(json.dumps({"type": "objekt"}))
    with pytest.raises(UserError, match=r"schema .*schema.json is not a valid JSON Schema"):
        check_file(document, given)


def test_unreadable_files_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        check_file(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        check_file(bad)
    bad.write_text(json.dumps(DOCUMENT))
    assert check_file(bad) == []
