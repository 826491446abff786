"""Wall time of `export-adapter` (with and without `--merge`) and `eval` on the tiny default, on this machine.

Trains `recipes/tiny_calc.yaml` on the CPU, then runs each command `--repeats` times as a user
would (a fresh `miniverl` process each time), beside a process that only imports torch,
transformers and peft, so the share of the imports is visible. Writes a JSON result.

    python benchmarks/export_cpu.py --out benchmarks/results/export_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(args: list[str], cwd: Path) -> tuple[float, str]:
    started = time.perf_counter()
    result = subprocess.run(args, capture_output=True, text=True, cwd=cwd)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return round(seconds, 2), result.stdout


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import peft
    import torch
    import transformers

    cli = [sys.executable, "-m", "miniverl.engine.cli.app"]
    work = Path(tempfile.mkdtemp(prefix="miniverl-export-bench-"))
    recipe = work / "tiny_calc.yaml"
    recipe.write_text((ROOT / "recipes" / "tiny_calc.yaml").read_text().replace("device: auto", "device: cpu"))
    run_seconds, _ = timed([*cli, "run", str(recipe), "--run-id", "tiny-demo", "--runs-dir", "runs"], work)
    manifest = json.loads((work / "runs" / "tiny-demo" / "manifest.json").read_text())
    rows: dict[str, list[float]] = {"export": [], "export --merge": [], "eval --adapter": [], "imports only": []}
    evaluated = None
    for _ in range(args.repeats):
        rows["export"].append(timed([*cli, "export-adapter", "tiny-demo", "--runs-dir", "runs", "--out", "exports/a",
                                     "--force"], work)[0])
        rows["export --merge"].append(timed([*cli, "export-adapter", "tiny-demo", "--runs-dir", "runs", "--out",
                                             "exports/m", "--merge", "--force"], work)[0])
        seconds, stdout = timed([*cli, "eval", "runs/tiny-demo/recipe.yaml", "--adapter", "exports/a", "--json"], work)
        rows["eval --adapter"].append(seconds)
        evaluated = json.loads(stdout)
        rows["imports only"].append(timed([sys.executable, "-c", "import torch, transformers, peft; "
                                           "from transformers import AutoModelForCausalLM; "
                                           "from peft import get_peft_model"], work)[0])

    def size(folder: Path) -> int:
        return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())

    record = {
        "command": f"python benchmarks/export_cpu.py --out {args.out} --repeats {args.repeats}",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
        "run_seconds": run_seconds,
        "strict_success": [manifest["verify_baseline"]["strict_success"], manifest["verify"]["strict_success"]],
        "seconds": rows,
        "eval_equals_manifest": all(evaluated[k] == manifest["verify"][k]
                                    for k in ("tasks", "tool_call_rate", "format_validity", "strict_success")),
        "adapter_dir_bytes": size(work / "exports" / "a"),
        "with_merged_bytes": size(work / "exports" / "m"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
