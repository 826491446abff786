"""Export and eval at the real Qwen3 shapes: an NF4-trained adapter leaves the tool, on one CUDA GPU.

Random-weight Qwen3-0.6B / 1.7B directories built from the published configs
(`qwen_assets.py`, the real tokenizer); `recipes/qwen_consumer_gpu_calc.yaml`
run for a few cycles with command-line overrides; then
`miniverl export-adapter --merge`, `PeftModel.from_pretrained` onto the NF4
base (missing / unexpected keys), the merged directory through
`AutoModelForCausalLM` alone (its dtype, no quantization config), and
`miniverl eval RUN_ID --adapter DIR` against the manifest (every rate and the
decoded turns of every held-out task). Writes a JSON result.

    python benchmarks/export_qwen.py --out benchmarks/results/export_qwen_h200.json

No result is recorded yet: the session that wrote this had no GPU lent. The
same code path is tested on the CPU with the tiny models (tests/e2e/test_export.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen_assets import ROOT, build_assets  # noqa: E402


def cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "miniverl.engine.cli.app", *args], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"miniverl {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result, seconds


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/miniverl-export-qwen"))
    parser.add_argument("--cycles", type=int, default=2)
    args = parser.parse_args()
    import torch

    assets = build_assets(args.work / "models", ("calc",))
    student, teacher = assets["dirs"]["qwen3-0.6b"], assets["dirs"]["qwen3-1.7b"]
    runs, out = args.work / "runs", args.work / "export"
    overrides = [f"models.student.path={student}", f"models.teacher.path={teacher}", f"train.cycles={args.cycles}",
                 "task.heldout_size=16", "verify.batch_size=16"]
    _, run_seconds = cli("run", str(ROOT / "recipes" / "qwen_consumer_gpu_calc.yaml"), *overrides,
                         "--run-id", "calc", "--runs-dir", str(runs))
    document = json.loads((runs / "calc" / "manifest.json").read_text())
    _, export_seconds = cli("export-adapter", "calc", "--runs-dir", str(runs), "--out", str(out), "--merge", "--force")

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16)
    base = AutoModelForCausalLM.from_pretrained(student, quantization_config=nf4, device_map={"": 0})
    model = PeftModel.from_pretrained(base, str(out))
    loaded = model.load_adapter(str(out), adapter_name="again")
    del model, base
    merged = AutoModelForCausalLM.from_pretrained(str(out / "merged"))
    merged_config = json.loads((out / "merged" / "config.json").read_text())
    merged_dtype = str(next(merged.parameters()).dtype)
    del merged
    torch.cuda.empty_cache()

    result, eval_seconds = cli("eval", "calc", "--runs-dir", str(runs), "--adapter", str(out), "--json")
    evaluated = json.loads(result.stdout)
    from miniverl.engine.core.artifacts import VerifyReport, read_artifact

    verify = read_artifact(runs / "calc" / "verify" / "report.msgpack", VerifyReport)
    rates = ("tasks", "tool_call_rate", "format_validity", "strict_success")
    card = (out / "README.md").read_text()
    record = {
        "command": "python benchmarks/export_qwen.py --out " + str(args.out),
        "machine": {"gpu": torch.cuda.get_device_name(0), "python": platform.python_version(),
                    "torch": torch.__version__},
        "recipe": "recipes/qwen_consumer_gpu_calc.yaml with " + " ".join(overrides[2:]) + " (random-weight models)",
        "run_seconds": round(run_seconds, 1),
        "export_seconds": round(export_seconds, 1),
        "eval_seconds": round(eval_seconds, 1),
        "adapter_bytes": (out / "adapter_model.safetensors").stat().st_size,
        "merged_bytes": (out / "merged" / "model.safetensors").stat().st_size,
        "peft_onto_nf4_base": {"missing_keys": len(loaded.missing_keys), "unexpected_keys": len(loaded.unexpected_keys)},
        "merged": {"config_dtype": merged_config.get("dtype") or merged_config.get("torch_dtype"),
                   "loaded_dtype": merged_dtype, "quantization_config": "quantization_config" in merged_config},
        "card_says_nf4": "trained against the NF4-quantized base" in card,
        "eval_equals_manifest": {key: evaluated[key] == document["verify"][key] for key in rates},
        "eval_turns_equal_verify_stage": [i["turns"] for i in evaluated["items"]] == [i.turns for i in verify.items],
        "manifest_verify": {key: document["verify"][key] for key in rates},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
