"""The commands a user lives in, each run as the real CLI on one small tiny-default run.

doctor, validate, run --dry-run, runs, inspect FILE, report, export-benchmark and
validate-benchmark. Outputs are compared with facts obtained independently: torch
and importlib for doctor, the model files and the run's own manifest for the dry
run's parameter counts, the manifest for the report's points and the exported
figures, a headless browser for the page.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from support import ROOT, SMALL, manifest, miniverl, recipe_dict, write_recipe
from miniverl.engine.report.benchmark_schema import problems as schema_problems
from miniverl.engine.core.recipe import parse_recipe, recipe_to_builtins
from miniverl.engine.core.rundir import Journal, RunDir

WIDE = {"COLUMNS": "200"}  # rich tables wrap at 80 columns when stdout is not a terminal
SMALL_TOKENS = recipe_dict()["rollout"]["max_total_tokens"]
OVERRIDES = ("report.tensorboard=true", "verify.min_tool_call_rate=0.25")


@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
    """One finished SMALL run, given two recipe keys as command-line overrides (one asks for TensorBoard scalars)."""
    tmp = tmp_path_factory.mktemp("commands")
    recipe = write_recipe(tmp, recipe_dict(**SMALL))
    runs = tmp / "runs"
    result = miniverl("run", str(recipe), *OVERRIDES, "--run-id", "small", "--runs-dir", str(runs))
    assert result.returncode == 0, result.stderr[-3000:]
    return runs, recipe, manifest(runs, "small")


def _user_error_lines(result) -> list[str]:
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    return [line for line in result.stderr.splitlines() if line.strip()]


def test_overrides_change_exactly_their_keys_in_the_saved_recipe_and_the_manifest_lists_them(done_run):
    runs, recipe, document = done_run
    saved = parse_recipe((runs / "small" / "recipe.yaml").read_text())
    expected = recipe_to_builtins(parse_recipe(recipe.read_text()))
    expected["report"]["tensorboard"], expected["verify"]["min_tool_call_rate"] = True, 0.25
    assert recipe_to_builtins(saved) == expected
    assert document["recipe"] == expected and document["overrides"] == list(OVERRIDES)
    assert document["quality_gate"]["min_tool_call_rate"] == 0.25


# ---------------------------------------------------------------- help
@pytest.mark.parametrize("command,option", [
    ("doctor", "--json"), ("validate", "--json"), ("run", "--dry-run"), ("runs", "--runs-dir"),
    ("inspect", "--limit"), ("report", "--out"), ("export-benchmark", "--notes"), ("validate-benchmark", "--schema"),
])
def test_help_of_each_command(command, option):
    result = miniverl(command, "--help", env=WIDE)
    assert result.returncode == 0, result.stderr
    assert option in result.stdout and "Usage" in result.stdout


def test_usage_errors_exit_2_without_a_traceback():
    missing = _user_error_lines(miniverl("validate"))
    assert any("Missing argument" in line for line in missing), missing
    unknown = _user_error_lines(miniverl("runs", "--bogus"))
    assert any("No such option: --bogus" in line for line in unknown), unknown


# ---------------------------------------------------------------- doctor
def test_doctor_json_matches_torch_and_installed_packages():
    result = miniverl("doctor", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["python"] == platform.python_version()
    assert report["torch"] == str(torch.__version__)
    assert report["cuda"]["build"] == torch.version.cuda
    assert report["cuda"]["usable"] == torch.cuda.is_available()
    expected_kind = "cuda" if torch.cuda.is_available() else "cpu"
    assert report["device"]["kind"] == expected_kind
    assert report["device"]["total_memory_bytes"] > 0 and report["device"]["free_memory_bytes"] > 0
    if expected_kind == "cpu":
        assert report["dtype_auto"]["value"] == "float32"
    deps = {d["name"]: d for d in report["dependencies"]}
    for name in ("transformers", "peft", "tokenizers"):
        assert deps[name]["status"] == "ok" and deps[name]["version"] == importlib.metadata.version(name)
    assert "CUDA library" in deps["bitsandbytes"]["detail"]


def test_doctor_works_without_the_train_extras(tmp_path):
    """Shadow packages make the optional imports fail the way a missing or broken install does."""
    for name in ("transformers", "peft", "tokenizers"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f'raise ModuleNotFoundError("No module named {name!r}", name={name!r})\n')
    (tmp_path / "bitsandbytes").mkdir()
    (tmp_path / "bitsandbytes" / "__init__.py").write_text("raise OSError('libbitsandbytes_cuda.so: cannot open')\n")
    result = miniverl("doctor", env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    for name in ("transformers", "peft", "tokenizers"):
        assert "not installed" in lines[name] and 'pip install "miniverl[train]"' in lines[name], lines[name]
    assert "import failed" in lines["bitsandbytes"] and "cannot open" in lines["bitsandbytes"]
    assert f"{torch.__version__}" in lines["torch"]
    assert "not ready to train" in result.stdout


# ---------------------------------------------------------------- validate
def test_validate_prints_the_resolved_configuration(tmp_path):
    recipe = write_recipe(tmp_path, recipe_dict(**{**SMALL, "models.device": "auto"}))
    result = miniverl("validate", str(recipe))
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:] if line.startswith("  ")}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"auto -> {device}" in rows["models.device"]
    for key in ("dtype", "memory.strategy", "optimizer.name"):
        assert "auto -> " in rows[key] and "(" in rows[key], rows[key]  # the value and why
    if device == "cpu":
        assert "auto -> float32" in rows["dtype"] and "auto -> adamw" in rows["optimizer.name"]
    assert rows["train.cycles"].split()[1] == "2"
    assert "(default)" in rows["optimizer.beta1"] and "(default)" not in rows["train.cycles"]


def test_validate_reports_every_problem_at_once(tmp_path):
    bad = recipe_dict(**{**SMALL, "train.cyclez": 3, "loss.chunk_size": 0, "rollout.top_p": 1.5})
    lines = _user_error_lines(miniverl("validate", str(write_recipe(tmp_path, bad))))
    assert len(lines) == 3, lines
    for key in ("train.cyclez: unknown key", "loss.chunk_size:", "rollout.top_p:"):
        assert sum(key in line for line in lines) == 1, (key, lines)


# ---------------------------------------------------------------- run --dry-run
def test_dry_run_checks_identity_tokenizer_adapter_and_memory(done_run):
    _, recipe, _ = done_run
    result = miniverl("run", str(recipe), "--dry-run", env=WIDE)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "no weights are loaded" in text
    assert text.count("Qwen3ForCausalLM") == 2 and text.count("= checkpoint") == 2  # config count = safetensors
    assert "byte-identical tokenizer files" in text and "padded rows 397..447 (51)" in text
    assert "LoRA r=8" in text
    for stage in ("preflight", "verify", "rollout", "teacher_score", "gradient", "optimizer_step"):
        assert re.search(rf"^\s*{stage}\s+[\d.]+", text, re.M), stage
    assert "fits by this estimate" in text and "only a real run proves the fit" in text


def test_dry_run_counts_match_the_loaded_models_and_refuses_a_bad_adapter_target(done_run, tmp_path):
    """The analytic counts equal what preflight counted on the loaded models; a typo'd module is named."""
    _, _, document = done_run
    bad = recipe_dict(**{**SMALL, "models.student.lora.target_modules": ["q_proj", "qq_proj"]})
    result = miniverl("run", str(write_recipe(tmp_path, bad)), "--dry-run", "--json")
    lines = _user_error_lines(result)
    assert len(lines) == 1 and "qq_proj" in lines[0] and "target_modules" in lines[0]
    report = json.loads(result.stdout)
    models = {m["role"]: m for m in report["models"]}
    loaded = {m["role"]: m for m in document["models"]}
    lora_good = document["adapter"]["trainable_parameters"]
    assert models["teacher"]["parameters_from_config"] == loaded["teacher"]["num_parameters"]
    # preflight counts the student with its (full, seven-module) adapter attached
    assert models["student"]["parameters_from_config"] + lora_good == loaded["student"]["num_parameters"]
    config = json.loads((Path(models["student"]["dir"]) / "config.json").read_text())
    kv_rollout = next(s for s in report["memory"]["stages"] if s["stage"] == "rollout")["kv_cache"]
    assert kv_rollout == (config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 2 * 4
                          * SMALL_TOKENS * SMALL["rollout.generation_batch_size"])
    assert report["tokenizer"]["tokenizer_size"] == 397 and report["tokenizer"]["padded_row_count"] == 51


# ---------------------------------------------------------------- runs and inspect
def _copy_run(runs: Path, target: Path, name: str, edit) -> None:
    shutil.copytree(runs / "small", target / name, ignore=shutil.ignore_patterns("lock", "lock.pid"))
    run = RunDir(target / name)
    journal = run.read_journal()
    edit(journal)
    run.write_journal(journal)


def test_runs_table_statuses(done_run, tmp_path):
    runs, _, document = done_run
    result = miniverl("runs", "--runs-dir", str(runs), env=WIDE)
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if "small" in line)
    before, after = document["verify_baseline"]["strict_success"], document["verify"]["strict_success"]
    for cell in ("done", "2/2", "manifest", f"{before:.1%} -> {after:.1%}"):
        assert cell in row, (cell, row)

    def killed(journal: Journal) -> None:  # a process died inside verify@final: the journal still says running
        del journal.stages["manifest"]
        journal.stages["verify@final"].state = "running"

    def failed(journal: Journal) -> None:
        del journal.stages["manifest"]
        journal.stages["verify@final"].state = "failed"

    many = tmp_path / "runs"
    _copy_run(runs, many, "killed", killed)
    _copy_run(runs, many, "failed", failed)
    _copy_run(runs, many, "live", lambda journal: None)
    with RunDir(many / "live").locked():  # held by this process, as a live run holds it
        listed = miniverl("runs", "--runs-dir", str(many), "--json")
    assert listed.returncode == 0, listed.stderr
    status = {row["run_id"]: row for row in json.loads(listed.stdout)}
    assert {k: v["status"] for k, v in status.items()} == {"killed": "incomplete", "failed": "failed", "live": "running"}
    assert status["killed"]["last_stage_done"] == "c000001/optimizer_step" and status["killed"]["cycles_done"] == 2


def test_inspect_accepts_an_artifact_file(done_run):
    runs, _, _ = done_run
    rollout = runs / "small" / "cycles" / "000001" / "rollout.msgpack"
    result = miniverl("inspect", str(rollout), "--limit", "1", env=WIDE)
    assert result.returncode == 0, result.stderr
    assert "rollout of cycle 1: 8 trajectories" in result.stdout
    assert "<|im_start|>user" in result.stdout  # spans decoded with the run's tokenizer, not token ids


# ---------------------------------------------------------------- report
def _points(html: str, series: str) -> int:
    return len(re.findall(rf'<circle class="point" data-series="{series}"', html))


@pytest.fixture(scope="module")
def report_page(done_run, tmp_path_factory):
    runs, _, _ = done_run
    out = tmp_path_factory.mktemp("report") / "report.html"
    result = miniverl("report", "small", "--runs-dir", str(runs), "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out, result.stdout


def test_report_has_one_point_per_cycle_and_no_external_urls(done_run, report_page):
    runs, _, document = done_run
    out, stdout = report_page
    html = out.read_text(encoding="utf-8")
    cycles = len(document["cycles"])
    for series in ("loss", "kl", "rollout-tool-call-rate", "rollout-strict-success"):
        assert _points(html, series) == cycles, series
    for c in document["cycles"]:  # the plotted values are the manifest's
        assert f"loss, cycle {c['cycle'] + 1}: {c['loss']:.4g}<" in html
    assert len(re.findall(r'<rect class="bar" data-series="(baseline|final)"', html)) == 6
    assert "http://" not in html and "https://" not in html and "<script" not in html
    assert '<span class="prompt">' in html and '<span class="model">' in html and "&lt;|im_start|&gt;" in html
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert "pip install tensorboard" in stdout
    else:
        assert list((runs / "small" / "tensorboard").glob("events.out.tfevents.*"))


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _console_messages(page: Path, profile: Path) -> list[str]:
    result = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
         "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=60)
    assert "<svg" in result.stdout or "bad" in page.name, result.stderr[-2000:]
    return [line for line in result.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not on PATH")
def test_report_renders_in_headless_chromium_without_console_errors(report_page, tmp_path):
    out, _ = report_page
    assert _console_messages(out, tmp_path / "profile") == []
    # The detector is live: an SVG attribute Chromium cannot parse is reported on its console.
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><body><svg width="9" height="9"><circle cx="NaN" cy="1" r="1"/></svg></body></html>')
    assert any("Expected length" in line for line in _console_messages(bad, tmp_path / "profile2"))


# ---------------------------------------------------------------- export-benchmark
def test_export_benchmark_validates_and_bad_documents_name_their_path(done_run, tmp_path):
    runs, _, document = done_run
    out = tmp_path / "result.json"
    result = miniverl("export-benchmark", "small", "--runs-dir", str(runs), "--notes", "CI CPU", "--out", str(out))
    assert result.returncode == 0, result.stderr
    exported = json.loads(out.read_text())
    schema = json.loads((ROOT / "benchmarks" / "hardware_result.schema.json").read_text())
    assert schema_problems(exported, schema) == []
    assert exported["notes"] == "CI CPU" and exported["provenance"]["torch"] == str(torch.__version__)
    assert [c["loss"] for c in exported["measurements"]["cycles"]] == [c["loss"] for c in document["cycles"]]
    assert exported["verifier"]["final"]["strict_success"] == document["verify"]["strict_success"]
    assert exported["measurements"]["rollout"]["generated_tokens"] > 0
    assert exported["provenance"]["tokenizer_sha256"] == document["tokenizer"]["student_sha256"]
    ok = miniverl("validate-benchmark", str(out))
    assert ok.returncode == 0 and "valid" in ok.stdout, ok.stderr

    missing, mistyped = copy.deepcopy(exported), copy.deepcopy(exported)
    del missing["provenance"]["torch"]
    mistyped["provenance"]["torch"] = 2
    mistyped["measurements"]["stages"][0]["seconds"] = "fast"
    for doc, expected in ((missing, ["$.provenance.torch: required field is missing"]),
                          (mistyped, ["$.provenance.torch: expected string",
                                      "$.measurements.stages[0].seconds: expected number"])):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(doc))
        lines = _user_error_lines(miniverl("validate-benchmark", str(path)))
        assert len(lines) == len(expected), lines
        for needle in expected:
            assert any(needle in line for line in lines), (needle, lines)


# ---------------------------------------------------------------- progress
def test_progress_bar_shows_its_unit_on_a_terminal_and_nothing_otherwise(monkeypatch):
    import io

    from rich.console import Console

    from miniverl.engine.core import progress

    buffer = io.StringIO()
    monkeypatch.setattr(progress, "console", Console(file=buffer, force_terminal=True, width=120))
    with progress.Reporter(enabled=True).bar("cycle 0 rollout", 8, "trajectories") as advance:
        advance(3)
    assert "trajectories" in buffer.getvalue() and "cycle 0 rollout" in buffer.getvalue()
    quiet = io.StringIO()
    monkeypatch.setattr(progress, "console", Console(file=quiet, force_terminal=False))
    reporter = progress.Reporter()
    assert reporter.enabled is False
    with reporter.bar("cycle 0 rollout", 8, "trajectories") as advance:
        advance(8)
    assert quiet.getvalue() == ""


def test_auto_batch_sizes_are_planned_recorded_and_shown_by_the_dry_run(tmp_path):
    """The plan resolves each `auto` once, in the dry run's words and in resolved.json and the manifest."""
    sizes = {"train.trajectory_batch_size": "auto", "rollout.generation_batch_size": "auto", "memory.budget": 3}
    recipe = write_recipe(tmp_path, recipe_dict(**{**SMALL, **sizes, "train.cycles": 1}))
    dry = miniverl("run", str(recipe), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    for key in ("memory.budget", "rollout.generation_batch_size", "train.trajectory_batch_size",
                "train.score_batch_size"):
        assert any(line.split()[:1] == [key] for line in dry.stdout.splitlines()), (key, dry.stdout)
    assert "auto: the gradient stage needs about" in dry.stdout
    runs = tmp_path / "runs"
    done = miniverl("run", str(recipe), "--run-id", "planned", "--runs-dir", str(runs))
    assert done.returncode == 0, done.stderr
    resolved = json.loads((runs / "planned" / "resolved.json").read_text())["resolved"]
    found = manifest(runs, "planned")
    for key in ("rollout.generation_batch_size", "train.trajectory_batch_size", "train.score_batch_size"):
        assert resolved[key]["value"] == "8", (key, resolved[key])  # 8 rollouts a cycle fit 3 GiB here
        assert found["resolved"][key] == resolved[key]
    assert resolved["memory.budget"] == {"value": "3.000 GiB", "reason": "requested by the recipe"}
    assert found["recipe"]["train"]["trajectory_batch_size"] == "auto"  # the recipe as written
    assert found["cycles"][0]["micro_batches"] == 1
