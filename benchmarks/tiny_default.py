"""Time the embedded default and its negative control end to end, as a user runs them.

    python benchmarks/tiny_default.py [--task calculator|sql|jsonl] [--seeds 0 1 2] [--out FILE]

Runs `miniverl run` on the task's tiny recipe (recipes/tiny_calc.yaml,
recipes/tiny_sql.yaml or recipes/tiny_jsonl_example.yaml; once per seed; seed 0
is the shipped recipe, other seeds change only `seed:`) and on its negative
control where it has one (recipes/tiny_*_raw_teacher.yaml), one after the other
in fresh run directories, and records wall time, the held-out strict success
before and after, tool-call rate, quality gate, the machine and versions.
Results: benchmarks/results/tiny_default_cpu.json (calculator),
tiny_sql_cpu.json, tiny_jsonl_cpu.json.
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


TASKS = {  # task -> (recipe, negative control or None, default result file)
    "calculator": ("recipes/tiny_calc.yaml", "recipes/tiny_calc_raw_teacher.yaml", "tiny_default_cpu.json"),
    "sql": ("recipes/tiny_sql.yaml", "recipes/tiny_sql_raw_teacher.yaml", "tiny_sql_cpu.json"),
    "jsonl": ("recipes/tiny_jsonl_example.yaml", None, "tiny_jsonl_cpu.json"),
}


def with_seed(recipe: str, seed: int, directory: Path) -> str:
    """The shipped recipe with only its seed changed (seed 0: the shipped file itself)."""
    if seed == 0:
        return recipe
    import yaml

    data = yaml.safe_load((ROOT / recipe).read_text())
    data["seed"] = seed
    path = ROOT / Path(recipe).parent / f".bench-seed{seed}-{Path(recipe).name}"  # beside it: relative task paths hold
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
    parser.add_argument("--task", choices=sorted(TASKS), default="calculator")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/<the task's result file>")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    recipe_file, control, result_file = TASKS[args.task]
    out = args.out or str(ROOT / "benchmarks" / "results" / result_file)
    results = []
    plan = [(recipe_file, seed) for seed in args.seeds] + ([(control, 0)] if control else [])
    for recipe, seed in plan:
        with tempfile.TemporaryDirectory() as tmp:
            seeded = with_seed(recipe, seed, Path(tmp))
            try:
                results.append({"seed": seed, **run_recipe(seeded, Path(tmp))})
            finally:
                if seeded != recipe:
                    Path(seeded).unlink()
            print(json.dumps({k: v for k, v in results[-1].items() if k not in ("environment", "stage_seconds")}))
    document = {
        "command": "python " + " ".join(["benchmarks/tiny_default.py", *sys.argv[1:]]),
        "machine": {"cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "results": results,
    }
    Path(out).write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
