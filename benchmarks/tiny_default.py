"""Time the embedded default and its negative control end to end, as a user runs them.

    python benchmarks/tiny_default.py [--seeds 0 1 2] [--out benchmarks/results/tiny_default_cpu.json]

Runs `miniverl run` on recipes/tiny_calc.yaml (once per seed; seed 0 is the
shipped recipe, other seeds change only `seed:`) and on
recipes/tiny_calc_raw_teacher.yaml, one after the other in fresh run
directories, and records wall time, the held-out strict success before and
after, tool-call rate, quality gate, the machine and versions.
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


def with_seed(recipe: str, seed: int, directory: Path) -> str:
    """The shipped recipe with only its seed changed (seed 0: the shipped file itself)."""
    if seed == 0:
        return recipe
    import yaml

    data = yaml.safe_load((ROOT / recipe).read_text())
    data["seed"] = seed
    path = directory / f"seed{seed}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def run_recipe(recipe: str, runs_dir: Path) -> dict:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "miniverl.engine.cli.app", "run", recipe, "--run-id", "bench",
                             "--runs-dir", str(runs_dir)], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{recipe} failed:\n{result.stderr[-3000:]}")
    manifest = json.loads((runs_dir / "bench" / "manifest.json").read_text())
    return {
        "recipe": recipe,
        "wall_seconds": round(seconds, 1),
        "strict_success_before": manifest["verify_baseline"]["strict_success"],
        "strict_success_after": manifest["verify"]["strict_success"],
        "tool_call_rate_after": manifest["verify"]["tool_call_rate"],
        "heldout_tasks": manifest["verify"]["tasks"],
        "quality_gate_passed": manifest["quality_gate"]["passed"],
        "loss_first_cycle": manifest["cycles"][0]["loss"],
        "loss_last_cycle": manifest["cycles"][-1]["loss"],
        "stage_seconds": {k: round(v["seconds"], 2) for k, v in manifest["stages"].items()},
        "environment": manifest["environment"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tiny_default_cpu.json"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    results = []
    plan = [("recipes/tiny_calc.yaml", seed) for seed in args.seeds] + [("recipes/tiny_calc_raw_teacher.yaml", 0)]
    for recipe, seed in plan:
        with tempfile.TemporaryDirectory() as tmp:
            results.append({"seed": seed, **run_recipe(with_seed(recipe, seed, Path(tmp)), Path(tmp))})
            print(json.dumps({k: v for k, v in results[-1].items() if k not in ("environment", "stage_seconds")}))
    document = {
        "command": "python " + " ".join(["benchmarks/tiny_default.py", *sys.argv[1:]]),
        "machine": {"cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "results": results,
    }
    Path(args.out).write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
