"""The rollout stage's share of a training cycle, plain forward-pass loop vs the CUDA-graph engine.

    python3 benchmarks/rollout_share.py --out benchmarks/results/rollout_share_h200.json

Builds the random-weight Qwen3-0.6B / Qwen3-1.7B pair of `qwen_pipeline.py` and
runs `recipes/qwen_consumer_gpu_calc.yaml` through the real CLI twice in one
process tree, identical except for `rollout.engine` (`plain`, then `auto`,
which is the CUDA-graph engine on CUDA). Random weights never stop early, so
every trajectory runs to the recipe's 704-token budget. Only the number of
cycles, rollouts per cycle and held-out tasks is reduced (recorded).

A cycle is rollout + teacher_score + gradient + optimizer_step; the share is
the rollout stage's seconds over the cycle's, per cycle, from `events.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen_pipeline import ROOT, build_assets, cli, environment, stage_table, write_recipe  # noqa: E402

CYCLE_STAGES = ("rollout", "teacher_score", "gradient", "optimizer_step")


def cycle_shares(stages: list[dict]) -> list[dict]:
    """Per cycle: seconds of each stage and the rollout's share of their sum."""
    cycles: dict[str, dict[str, float]] = {}
    for row in stages:
        cycle, _, name = row["stage"].partition("/")
        if name in CYCLE_STAGES:
            cycles.setdefault(cycle, {})[name] = row["seconds"]
    out = []
    for cycle, seconds in sorted(cycles.items()):
        total = sum(seconds.values())
        out.append({"cycle": cycle, "seconds": seconds, "cycle_seconds": round(total, 2),
                    "rollout_share": round(seconds.get("rollout", 0.0) / total, 4) if total else None})
    return out


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = ["# Rollout share of a cycle, plain loop vs CUDA-graph engine (Qwen3 calc recipe, random weights)", "",
             f"GPU {env.get('gpu')}; torch {env.get('torch')}, transformers {env.get('transformers')}, "
             f"bitsandbytes {env.get('bitsandbytes')}.", "", f"Command: `{result['command']}`", "",
             f"Overrides of the shipped recipe: `{json.dumps(result['overrides'])}`.", "",
             "| rollout.engine | cycle | rollout s | teacher_score s | gradient s | optimizer_step s | rollout share |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for engine, run in result["runs"].items():
        for c in run.get("cycles", []):
            s = c["seconds"]
            lines.append(f"| {engine} | {c['cycle']} | {s.get('rollout', 0):.1f} | {s.get('teacher_score', 0):.1f} | "
                         f"{s.get('gradient', 0):.1f} | {s.get('optimizer_step', 0):.1f} | {c['rollout_share']:.1%} |")
    if "rollout_speedup" in result:
        lines += ["", f"Rollout stage, plain / engine seconds (same prompts, seeds and budgets): "
                      f"{result['rollout_speedup']:.1f}x."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "rollout_share_h200.json")
    parser.add_argument("--work", type=Path, default=Path("/tmp/rollout_share"))
    parser.add_argument("--cycles", type=int, default=1)
    parser.add_argument("--rollouts", type=int, default=4)
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    assets = build_assets(args.work, ("calc",))
    overrides = {"train.cycles": args.cycles, "train.rollouts_per_cycle": args.rollouts, "task.heldout_size": 1,
                 "verify.max_new_tokens_per_turn": 8}
    result: dict = {"command": "python3 " + " ".join(sys.argv), "environment": environment(),
                    "overrides": overrides, "runs": {}}
    for engine in ("plain", "auto"):
        recipe = write_recipe("qwen_consumer_gpu_calc.yaml", {
            **overrides, "rollout.engine": engine, "models.student.path": assets["dirs"]["qwen3-0.6b"],
            "models.teacher.path": assets["dirs"]["qwen3-1.7b"]}, args.work / f"calc-{engine}.yaml")
        started = time.perf_counter()
        step = cli(["run", str(recipe), "--run-id", engine, "--runs-dir", str(args.work / "runs")],
                   args.work / "log.txt")
        run = {"rc": step["rc"], "wall_seconds": round(time.perf_counter() - started, 1)}
        events = args.work / "runs" / engine / "events.jsonl"
        if events.is_file():
            run["cycles"] = cycle_shares(stage_table(args.work / "runs" / engine))
        result["runs"][engine] = run
    plain, fast = (result["runs"][k].get("cycles", []) for k in ("plain", "auto"))
    if plain and fast:
        result["rollout_speedup"] = round(sum(c["seconds"]["rollout"] for c in plain)
                                          / sum(c["seconds"]["rollout"] for c in fast), 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, sort_keys=True, default=str))
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
