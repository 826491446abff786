"""The trained student outside the tool: `export-adapter` and `eval`, each as the real CLI.

One tiny-default run is trained to its end; its exported directory is loaded
with peft and with transformers alone (never miniverl's loader) and decoded on
the held-out tasks, which must give token for token what the run's own verify
stage decoded. Kill points inside the export must leave no directory or a
complete one, and every bad input is one line with nothing left behind.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support import SMALL, manifest, miniverl, recipe_dict, write_recipe
from miniverl.engine.core.artifacts import VerifyReport, read_artifact
from miniverl.engine.core.recipe import parse_recipe
from miniverl.engine.models.loading import ASSETS_DIR
from miniverl.engine.rollout.engines import run_episodes
from miniverl.engine.rollout.loop import Budget, SamplingPolicy
from miniverl.engine.tasks import registry
from miniverl.stages.verify import heldout_items

STUDENT_BASE = ASSETS_DIR / "student_base"
ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors", "README.md", "miniverl_provenance.json",
                 "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
MERGED_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny default trained to its end (as shipped, on the CPU), and its export with --merge."""
    tmp = tmp_path_factory.mktemp("export")
    runs = tmp / "runs"
    recipe = write_recipe(tmp, recipe_dict(**{"models.device": "cpu"}))
    result = miniverl("run", str(recipe), "--run-id", "calc", "--runs-dir", str(runs))
    assert result.returncode == 0, result.stderr[-3000:]
    document = manifest(runs, "calc")
    assert document["verify"]["strict_success"] > document["verify_baseline"]["strict_success"]
    out = tmp / "exports" / "calc"  # the parent does not exist yet: export creates it
    result = miniverl("export-adapter", "calc", "--runs-dir", str(runs), "--out", str(out), "--merge")
    assert result.returncode == 0, result.stderr[-3000:]
    return runs, out, document


def _verify_items(runs: Path):
    return read_artifact(runs / "calc" / "verify" / "report.msgpack", VerifyReport).items


def _greedy(model, tokenizer, runs: Path):
    """The held-out episodes of the run's recipe, decoded greedily with `model` as the verify stage decodes."""
    recipe = parse_recipe((runs / "calc" / "recipe.yaml").read_text())
    task, _ = registry.load_task(recipe, runs / "calc")
    budget = Budget(recipe.rollout.max_turns, recipe.verify.max_new_tokens_per_turn, recipe.rollout.max_total_tokens)
    with torch.no_grad():
        episodes = run_episodes(model, tokenizer, task, heldout_items(recipe, task), SamplingPolicy(greedy=True),
                                budget, None, len(tokenizer), "cpu", recipe.verify.batch_size,
                                engine=recipe.rollout.engine)
    return episodes


def _assert_same_as_verify(episodes, items, tokenizer) -> None:
    assert len(episodes) == len(items)
    for ep, item in zip(episodes, items):
        assert ep.task.task_id == item.task_id
        assert ep.turns == item.turns  # every model turn, as text
        # and token for token: the verify stage's turn texts encode to the tokens this model produced
        produced = [tokenizer(t, add_special_tokens=False).input_ids for t in ep.turns]
        expected = [tokenizer(t, add_special_tokens=False).input_ids for t in item.turns]
        assert produced == expected
        assert ep.verdict().strict_success == item.strict_success


def test_the_adapter_directory_is_standard_peft_and_decodes_as_the_verify_stage(trained):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    runs, out, document = trained
    assert {p.name for p in out.iterdir() if p.is_file()} == ADAPTER_FILES
    config = json.loads((out / "adapter_config.json").read_text())
    lora = document["recipe"]["models"]["student"]["lora"]
    assert (config["peft_type"], config["task_type"]) == ("LORA", "CAUSAL_LM")
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (
        lora["r"], lora["alpha"], sorted(lora["target_modules"]))
    assert (config["base_model_name_or_path"], config["revision"]) == ("miniverl-builtin/student_base", None)

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(STUDENT_BASE)), str(out))
    again = model.load_adapter(str(out), adapter_name="again")  # what peft reports when it loads the file
    assert again.missing_keys == [] and again.unexpected_keys == []
    model.set_adapter("default")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))  # the exported tokenizer and chat template
    _assert_same_as_verify(_greedy(model, tokenizer, runs), _verify_items(runs), tokenizer)


def test_the_key_names_are_the_hugging_face_modules_the_loaders_look_up(trained):
    """vLLM and SGLang map `base_model.model.<module>.lora_A.weight` onto the HF model's module names."""
    from transformers import AutoModelForCausalLM

    _, out, document = trained
    names = set(load_file(str(out / "adapter_model.safetensors")))
    hf_modules = dict(AutoModelForCausalLM.from_pretrained(str(STUDENT_BASE)).named_modules())
    targets = set(document["recipe"]["models"]["student"]["lora"]["target_modules"])
    pattern = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<half>[AB])\.weight$")
    modules = set()
    for name in names:
        match = pattern.match(name)
        assert match, name
        module = match["module"]
        assert module in hf_modules and module.rsplit(".", 1)[1] in targets, name
        assert isinstance(hf_modules[module], torch.nn.Linear)
        modules.add(module)
    adapted = {name for name, m in hf_modules.items() if name.rsplit(".", 1)[-1] in targets}
    assert modules == adapted and len(names) == 2 * len(adapted)  # both halves of every targeted Linear


def test_the_merged_model_loads_without_peft_and_decodes_as_the_verify_stage(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    runs, out, _ = trained
    merged = out / "merged"
    assert {p.name for p in merged.iterdir()} == MERGED_FILES
    config = json.loads((merged / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"  # the base's own dtype
    model = AutoModelForCausalLM.from_pretrained(str(merged))
    assert not any("lora" in name for name, _ in model.named_parameters())
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(merged))
    _assert_same_as_verify(_greedy(model, tokenizer, runs), _verify_items(runs), tokenizer)


def test_the_card_names_the_provenance(trained):
    runs, out, document = trained
    card = (out / "README.md").read_text()
    provenance = json.loads((out / "miniverl_provenance.json").read_text())
    adapter_sha = provenance["adapter_sha256"]
    for fact in ("calc", "tiny_calc", "miniverl-builtin/student_base", document["models"][0]["config_sha256"],
                 adapter_sha, document["adapter_sha256"], "the run's final adapter",
                 f"{document['verify_baseline']['strict_success']:.1%} | {document['verify']['strict_success']:.1%}",
                 "Quality gate: **passed**", "vllm serve", "## Merged model"):
        assert fact in card, fact
    assert provenance["checkpoint_adapter_sha256"] == document["adapter_sha256"]
    assert (provenance["step"], provenance["run_finished"]) == (document["recipe"]["train"]["cycles"], True)
    assert card.startswith("---\nbase_model: miniverl-builtin/student_base\nlibrary_name: peft\n")
    umask = os.umask(0)
    os.umask(umask)
    assert all(f.stat().st_mode & 0o777 == 0o666 & ~umask for f in out.rglob("*") if f.is_file())  # servable


def _eval(*args: str) -> dict:
    result = miniverl("eval", *args, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_eval_reproduces_the_manifest_exactly(trained):
    runs, out, document = trained
    recipe = runs / "calc" / "recipe.yaml"
    exported = _eval(str(recipe), "--adapter", str(out))
    base = _eval(str(recipe), "--base")
    of_run = _eval("calc", "--runs-dir", str(runs))
    for result, expected in ((exported, document["verify"]), (of_run, document["verify"]),
                             (base, document["verify_baseline"])):
        for key in ("tasks", "tool_call_rate", "format_validity", "strict_success"):
            assert result[key] == expected[key], key
    assert [i["turns"] for i in exported["items"]] == [i.turns for i in _verify_items(runs)]
    assert of_run["adapter_sha256"] == document["adapter_sha256"]
    assert len(_eval(str(recipe), "--base", "--n", "5")["items"]) == 5


def test_eval_prints_the_rates_and_the_first_failures(trained):
    runs, _, document = trained
    result = miniverl("eval", str(runs / "calc" / "recipe.yaml"), "--base", "--n", "8", env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "base on 8 held-out tasks" in result.stdout and "strict success" in result.stdout
    assert "failed; the first 5:" in result.stdout  # the untrained student fails them all


# ---------------------------------------------------------------- crash safety
def _complete(out: Path, reference: Path) -> None:
    assert {p.name for p in out.iterdir()} == {p.name for p in reference.iterdir()}
    assert {p.name for p in (out / "merged").iterdir()} == MERGED_FILES
    for name in ("adapter_model.safetensors", "adapter_config.json", "miniverl_provenance.json"):
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    assert (out / "merged" / "model.safetensors").read_bytes() == (reference / "merged" / "model.safetensors").read_bytes()


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".partial-" in p.name or ".replaced-" in p.name]


@pytest.mark.parametrize("point,force", [
    ("export:adapter-saved", False), ("export:merged-saved", False), ("export:card-written", False),
    ("export:filled", False), ("export:renamed", False), ("export:old-moved", True),
])
def test_a_kill_inside_export_leaves_no_directory_or_a_complete_one(trained, tmp_path, point, force):
    runs, reference, _ = trained
    out = tmp_path / "adapter"
    args = ("export-adapter", "calc", "--runs-dir", str(runs), "--out", str(out), "--merge")
    if force:  # replacing an earlier export: the old one must survive a kill whole, or the new one be there whole
        assert miniverl(*args).returncode == 0
    killed = miniverl(*args, *(["--force"] if force else []), env={"MINIVERL_FAULT_KILL_AT": point})
    assert killed.returncode == -9, killed.stderr[-2000:]
    if out.exists():
        _complete(out, reference)
    else:
        assert point in ("export:adapter-saved", "export:merged-saved", "export:card-written", "export:filled",
                         "export:old-moved")
    again = miniverl(*args, "--force")
    assert again.returncode == 0, again.stderr[-2000:]
    _complete(out, reference)
    assert _leftovers(tmp_path) == []


# ---------------------------------------------------------------- bad inputs
@pytest.fixture(scope="module")
def unfinished(tmp_path_factory):
    """A SMALL run killed once its first optimizer step is journaled: steps 0 and 1 of 2 exist."""
    tmp = tmp_path_factory.mktemp("unfinished")
    runs = tmp / "runs"
    recipe = write_recipe(tmp, recipe_dict(**SMALL))
    result = miniverl("run", str(recipe), "--run-id", "half", "--runs-dir", str(runs),
                      env={"MINIVERL_FAULT_KILL_AT": "c000000/optimizer_step:journaled"})
    assert result.returncode == -9, result.stderr[-2000:]
    return runs


def _one_line(result, needle: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_an_unfinished_run_exports_only_the_step_asked_for(unfinished, tmp_path):
    out = tmp_path / "half"
    _one_line(miniverl("export-adapter", "half", "--runs-dir", str(unfinished), "--out", str(out)),
              "run half is not finished (latest checkpoint: step 1 of 2); pass --step 1")
    _one_line(miniverl("export-adapter", "half", "--runs-dir", str(unfinished), "--out", str(out), "--step", "2"),
              "--step 2 is not trained yet: run half has reached step 1")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    _one_line(miniverl("eval", "half", "--runs-dir", str(unfinished)), "run half is not finished")
    result = miniverl("export-adapter", "half", "--runs-dir", str(unfinished), "--out", str(out), "--step", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    card = (out / "README.md").read_text()
    assert "**the run was not finished**" in card and "no verifier results yet" in card
    assert json.loads((out / "miniverl_provenance.json").read_text())["run_finished"] is False


def _unwritable(tmp_path: Path) -> Path:
    """A directory this process cannot write into, even as root (where permission bits do not stop it)."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        return locked / "adapter"
    return Path("/sys/miniverl-export-test/adapter")  # sysfs takes no new directories, not even root's


def test_bad_export_inputs_exit_2_with_one_line_and_leave_nothing(trained, tmp_path):
    runs, _, _ = trained
    out = tmp_path / "adapter"

    def export(*args: str):
        return miniverl("export-adapter", *args, "--runs-dir", str(runs))

    _one_line(export("nope", "--out", str(out)), "no run nope in")
    _one_line(export("calc", "--out", str(out), "--step", "41"), "--step 41 is out of range: run calc has steps 0..40")
    _one_line(export("calc", "--out", str(out), "--step", "-1"), "--step -1 is out of range")
    _one_line(export("calc", "--out", str(out), "--step", "5"), "--step 5: checkpoints/000005/checkpoint.msgpack was "
              "removed by the run's retention policy")
    (tmp_path / "a_file").write_text("x")
    _one_line(export("calc", "--out", str(tmp_path / "a_file" / "adapter")), "is a file, not a directory")
    _one_line(export("calc", "--out", str(_unwritable(tmp_path))), "cannot write --out")
    out.mkdir()
    _one_line(export("calc", "--out", str(out)), f"--out {out} already exists; pass --force")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "adapter", *(["locked"] if os.geteuid() else [])]
    assert list(out.iterdir()) == [] and _leftovers(tmp_path) == []


def test_bad_eval_inputs_exit_2_with_one_line(trained, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    runs, out, _ = trained
    recipe = str(runs / "calc" / "recipe.yaml")
    sql = write_recipe(tmp_path, recipe_dict("tiny_sql.yaml", **{"models.device": "cpu"}), "sql.yaml")
    _one_line(miniverl("eval", str(sql), "--adapter", str(out)),
              f"--adapter {out} was trained for the base miniverl-builtin/student_base, but the recipe's student "
              f"is miniverl-builtin/sql/student_base")
    # An adapter that names this base but was made for another shape (the wider tiny teacher).
    wrong = get_peft_model(AutoModelForCausalLM.from_pretrained(str(ASSETS_DIR / "protocol_teacher")),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    wrong.peft_config["default"].base_model_name_or_path = "miniverl-builtin/student_base"
    wrong.save_pretrained(str(tmp_path / "wrong"), save_embedding_layers=False)
    _one_line(miniverl("eval", recipe, "--adapter", str(tmp_path / "wrong")), "does not fit the student")
    _one_line(miniverl("eval", recipe, "--adapter", str(tmp_path / "absent")), "no such directory")
    _one_line(miniverl("eval", recipe), "needs --adapter DIR or --base")
    _one_line(miniverl("eval", recipe, "--base", "--adapter", str(out)), "exclude each other")
    _one_line(miniverl("eval", "nope", "--runs-dir", str(runs)), "nope is neither a recipe file nor a run")
    _one_line(miniverl("eval", recipe, "--base", "--n", "0"), "--n 0: evaluate between 1 and")
    _one_line(miniverl("eval", "calc", "--runs-dir", str(runs), "--base", "--step", "40"), "does not go with")
    _one_line(miniverl("eval", "calc", "--runs-dir", str(runs), "--step", "5"), "--step 5: checkpoints/000005")
