"""The model card (`README.md`) of an exported adapter: what it is, where it came from, how well it did."""

from __future__ import annotations

from miniverl.engine.core import layout
from miniverl.engine.export.run_checkpoint import RunCheckpoint


def _step_note(source: RunCheckpoint) -> str:
    cycles = source.recipe.train.cycles
    if source.is_final:
        return f"{source.step} of {cycles}: the run's final adapter, the one its verifier scored"
    if not source.finished:
        return (f"{source.step} of {cycles}; **the run was not finished** when this was exported "
                f"(`--step {source.step}` was asked for explicitly)")
    return f"{source.step} of {cycles}, an earlier checkpoint than the final one the verifier scored"


def _results(source: RunCheckpoint) -> list[str]:
    manifest = source.manifest
    if manifest is None:
        return ["The run has no verifier results yet (it is not finished): "
                "`miniverl eval RECIPE --adapter DIR` scores this adapter."]
    before, after, gate = manifest.verify_baseline, manifest.verify, manifest.quality_gate
    lines = [
        f"Strict held-out verifier of the run ({after.tasks} held-out tasks, greedy decoding):",
        "",
        "| | before training (step 0) | after (final step) |",
        "| --- | --- | --- |",
        f"| strict success | {before.strict_success:.1%} | {after.strict_success:.1%} |",
        f"| tool-call rate | {before.tool_call_rate:.1%} | {after.tool_call_rate:.1%} |",
        f"| format validity | {before.format_validity:.1%} | {after.format_validity:.1%} |",
        "",
        f"Quality gate: **{'passed' if gate.passed else 'FAILED'}** ({gate.reason}; "
        f"tool-call rate at least {gate.min_tool_call_rate:.0%} and strict success above the baseline).",
    ]
    if not source.is_final:
        lines += ["", f"These figures are the final step's, not step {source.step}'s: "
                      "`miniverl eval RECIPE --adapter DIR` scores this adapter."]
    return lines


def model_card(source: RunCheckpoint, adapter_sha256: str, recipe_text: str, merged_dtype: str | None) -> str:
    recipe, student_spec = source.recipe, source.recipe.models.student
    student, teacher = source.model("student"), source.model("teacher")
    lora = student_spec.lora
    nf4 = student_spec.quantization == "nf4"
    trained_on = ("NF4 (bitsandbytes 4-bit, double-quantized), computing in "
                  f"{source.preflight.resolved['dtype'].value}" if nf4 else source.preflight.resolved["dtype"].value)
    run_id = source.run.root.name
    lines = [
        "---",
        f"base_model: {student.id}",
        "library_name: peft",
        "pipeline_tag: text-generation",
        "tags: [miniverl, lora, on-policy-distillation]",
        "---",
        f"# {run_id}: a LoRA adapter for {student.id}",
        "",
        f"Trained by miniverl's on-policy distillation from the teacher {teacher.id} on the task "
        f"`{recipe.task.name}`: the student sampled its own tool-use trajectories and the teacher scored "
        f"every generated token.",
        "",
        "| | |",
        "| --- | --- |",
        f"| run | `{run_id}` (recipe `{recipe.name}`) |",
        f"| step | {_step_note(source)} |",
        f"| base | `{student.id}` revision `{student.revision or 'unpinned'}`, config.json sha256 `{student.config_sha256}` |",
        f"| base weights while training | {trained_on} |",
        f"| teacher | `{teacher.id}` revision `{teacher.revision or 'unpinned'}`, config.json sha256 `{teacher.config_sha256}` |",
        f"| tokenizer | sha256 `{source.preflight.tokenizer.student_sha256}` (the files here are the run's) |",
        f"| LoRA | r {lora.r}, alpha {lora.alpha:g}, on {', '.join(lora.target_modules)} |",
        f"| adapter_model.safetensors | sha256 `{adapter_sha256}` |",
        f"| the run's checkpoint | `{layout.adapter_ref(source.step).path}`, sha256 `{source.checkpoint.adapter_sha256}` |",
        "",
        *_results(source),
        "",
        "## Use it",
        "",
        "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'base = AutoModelForCausalLM.from_pretrained("{student.id}")',
        'model = PeftModel.from_pretrained(base, "THIS_DIRECTORY")',
        'tokenizer = AutoTokenizer.from_pretrained("THIS_DIRECTORY")',
        "```",
        "",
        f"Serve it with vLLM: `vllm serve {student.id} --enable-lora --lora-modules {recipe.name}=THIS_DIRECTORY "
        f"--max-lora-rank {max(8, lora.r)}`.",
    ]
    if student.id.startswith("miniverl-builtin/"):
        lines += ["", f"The base is one of miniverl's embedded tiny models: its files are in the miniverl package "
                      f"at `engine/assets/tiny/{student.id.split('/', 1)[1]}`."]
    if merged_dtype is not None:
        lines += ["", "## Merged model", "",
                  f"`merged/` holds the base with this adapter merged into its weights, in {merged_dtype}, with the "
                  f"tokenizer: `AutoModelForCausalLM.from_pretrained(\"THIS_DIRECTORY/merged\")` needs no peft."]
        if nf4:
            lines += ["", "The adapter was trained against the NF4-quantized base; merged into the unquantized "
                          "weights, the model's outputs differ slightly from those the verifier measured."]
    lines += ["", "## Recipe", "", "The run's `recipe.yaml`:", "", "```yaml", recipe_text.rstrip("\n"), "```", ""]
    return "\n".join(lines)
