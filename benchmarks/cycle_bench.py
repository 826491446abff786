"""The calc recipe's cycle under the memory plan at 4 and 8 GiB budgets, next to the engine before it, on one GPU.

    git worktree add /tmp/baseline 040e389   # the engine before the memory plan and the fused loss
    python3 benchmarks/cycle_bench.py --baseline /tmp/baseline --out benchmarks/results/cycle_bench_h200.json

Random-weight Qwen3-0.6B / Qwen3-1.7B at the published shapes with the real
tokenizer (`qwen_assets.build_assets`), so every trajectory runs to its token
budget (the worst case). Each configuration is a real `miniverl run` of
`recipes/qwen_consumer_gpu_calc.yaml` with a few overrides, 3 cycles; the
per-stage seconds and peak allocated memory come from the run's own
events.jsonl, cycle 0 (CUDA graphs, Triton kernels compiled, pinned copies made)
reported apart from cycles 1-2.

- `baseline`: the engine at `--baseline` (a checkout of an older commit) with
  that commit's shipped recipe: generation batch 1, micro-batch 1, chunk 16.
- `plan_4gib`, `plan_8gib`: this engine's recipe (every batch size `auto`)
  at `memory.budget` 4 and 8; `plan_4gib_packed` the same at 4 without
  `rollout.dense_copy` (decoding on the packed NF4 weights).
- `side_by_side_*`: the comparison work with the other implementation of
  the spec (6 rollouts, 96 new tokens per turn, `topk_tail` top-64, chunk
  256) with the baseline engine and with this one at a 4 GiB budget.
- `--profile`: each run under cProfile; the JSON keeps the top functions by
  cumulative and own host seconds (where a stage's time goes besides the GPU).
- `decode`: `benchmarks/rollout_bench.py` (bf16 and NF4 decode step at batch
  1, 8, 32 with its fraction of the measured copy bandwidth), with `--decode`.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen_assets import build_assets  # noqa: E402
from qwen_pipeline import cli, environment, write_recipe  # noqa: E402

GIB = 2**30
COMMON = {"train.cycles": 3, "task.heldout_size": 2, "verify.max_new_tokens_per_turn": 32}
SIDE_BY_SIDE = {"train.rollouts_per_cycle": 6, "rollout.max_new_tokens_per_turn": 96,
                "loss.mode": "topk_tail", "loss.topk": 64, "loss.chunk_size": 256, "memory.min_chunk_size": 16}


def stages_by_cycle(run_dir: Path) -> dict:
    """Per cycle: each stage's seconds and peak allocated bytes (the final attempt), and the cycle's sum."""
    cycles: dict[int, dict] = {}
    others: dict[str, dict] = {}
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("event") != "stage_end":
            continue
        stage = event["stage"]
        entry = {"seconds": event["seconds"], "peak_allocated_gib": event["peak_memory_bytes"] / GIB,
                 "peak_reserved_gib": event.get("peak_reserved_bytes", 0) / GIB}
        if stage.startswith("c") and "/" in stage:
            cycle, name = stage.split("/", 1)
            cycles.setdefault(int(cycle[1:]), {})[name] = entry
        else:
            others[stage] = entry
    table = {}
    for cycle, stages in sorted(cycles.items()):
        table[cycle] = {"stages": stages, "seconds": sum(s["seconds"] for s in stages.values()),
                        "peak_allocated_gib": max(s["peak_allocated_gib"] for s in stages.values())}
    return {"cycles": table, "other_stages": others,
            "peak_allocated_gib": max([c["peak_allocated_gib"] for c in table.values()]
                                      + [s["peak_allocated_gib"] for s in others.values()])}


def profile_summary(path: Path, top: int = 60) -> dict:
    """The functions that took the run's host time, by cumulative and by own seconds (cProfile)."""
    stats = pstats.Stats(str(path))
    rows, ours = [], []
    for (file, line, func), (_calls, ncalls, own, cumulative, _callers) in stats.stats.items():
        row = {"function": f"{Path(file).name}:{line}:{func}", "calls": ncalls, "own_s": round(own, 4),
               "cumulative_s": round(cumulative, 4)}
        rows.append(row)
        if "/miniverl/" in file or file.startswith(str(ROOT)):
            ours.append({**row, "function": f"{Path(file).parent.name}/{row['function']}"})
    return {"total_s": round(stats.total_tt, 3),
            "by_cumulative": sorted(rows, key=lambda r: -r["cumulative_s"])[:top],
            "by_own": sorted(rows, key=lambda r: -r["own_s"])[:top],
            "miniverl_by_cumulative": sorted(ours, key=lambda r: -r["cumulative_s"])[:2 * top]}


def one_run(name: str, recipe_file: Path, overrides: dict, work: Path, log: Path, env: dict | None,
            budget_gib: float | None, profile: bool = False) -> dict:
    recipe = write_recipe(str(recipe_file), {**COMMON, **overrides}, work / f"{name}.yaml")
    run_id = f"bench-{name}"
    profile_file = work / f"{name}.pstats"
    step = cli(["run", str(recipe), "--run-id", run_id, "--runs-dir", str(work / "runs")], log, env, timeout=540,
               python_args=("-m", "cProfile", "-o", str(profile_file)) if profile else ())
    run_dir = work / "runs" / run_id
    result: dict = {"command": step, "overrides": {**COMMON, **overrides}}
    if profile and profile_file.is_file():
        result["host_profile"] = profile_summary(profile_file)
    if (run_dir / "events.jsonl").is_file():
        result.update(stages_by_cycle(run_dir))
    if (run_dir / "resolved.json").is_file():
        result["plan"] = json.loads((run_dir / "resolved.json").read_text())["resolved"]
    later = [c for k, c in result.get("cycles", {}).items() if k >= 1]
    if later:
        result["cycle_seconds_after_warmup"] = [round(c["seconds"], 3) for c in later]
    if budget_gib is not None and "peak_allocated_gib" in result:
        result["peak_within_budget"] = result["peak_allocated_gib"] <= budget_gib
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/cycle_bench"))
    parser.add_argument("--baseline", type=Path, help="a checkout of the engine to compare with (its repository root)")
    parser.add_argument("--decode", action="store_true", help="also run benchmarks/rollout_bench.py")
    parser.add_argument("--only", action="append", help="run only these configurations")
    parser.add_argument("--profile", action="store_true",
                        help="run each configuration under cProfile and record where its host time went")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    log = args.work / "log.txt"
    result: dict = {"command": "python3 " + " ".join(sys.argv), "environment": environment(), "runs": {}}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))

    assets = build_assets(args.work, ("calc",))
    paths = {"models.student.path": assets["dirs"]["qwen3-0.6b"], "models.teacher.path": assets["dirs"]["qwen3-1.7b"]}
    ours = ROOT / "recipes" / "qwen_consumer_gpu_calc.yaml"
    configs: list[tuple[str, Path, dict, dict | None, float | None]] = [
        ("plan_4gib", ours, {**paths, "memory.budget": 4}, None, 4.0),
        ("plan_4gib_packed", ours, {**paths, "memory.budget": 4, "rollout.dense_copy": False}, None, 4.0),
        ("plan_8gib", ours, {**paths, "memory.budget": 8}, None, 8.0),
        ("side_by_side_plan_4gib", ours, {**paths, **SIDE_BY_SIDE, "memory.budget": 4}, None, 4.0),
    ]
    if args.baseline is not None:
        # The baseline runs from its own source tree: a shim puts its engine/ and stages/ under `miniverl`.
        shim = args.work / "baseline_shim" / "miniverl"
        shim.mkdir(parents=True, exist_ok=True)
        for part in ("engine", "stages"):
            link = shim / part
            if not link.exists():
                link.symlink_to(args.baseline.resolve() / part)
        env = {"PYTHONPATH": os.pathsep.join([str(shim.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(
            os.pathsep) if p and "shim" not in p])}
        old = args.baseline.resolve() / "recipes" / "qwen_consumer_gpu_calc.yaml"
        configs = [("baseline", old, paths, env, None),
                   ("side_by_side_baseline", old, {**paths, **SIDE_BY_SIDE, "rollout.generation_batch_size": 6}, env,
                    None)] + configs
    for name, recipe_file, overrides, env, budget in configs:
        if args.only and name not in args.only:
            continue
        started = time.perf_counter()
        result["runs"][name] = one_run(name, recipe_file, overrides, args.work, log, env, budget, args.profile)
        result["runs"][name]["wall_seconds"] = round(time.perf_counter() - started, 1)
        save()
        print(name, json.dumps({k: v for k, v in result["runs"][name].items() if k not in ("plan", "cycles")},
                               default=str)[:600], flush=True)
    if args.decode:
        out_dir = args.work / "decode"
        step = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "rollout_bench.py"), "--out-dir", str(out_dir),
                               "--rollout-tasks", "8"], capture_output=True, text=True, cwd=ROOT, timeout=400)
        found = sorted(out_dir.glob("*.json"))
        result["decode"] = json.loads(found[0].read_text()) if found else {"error": (step.stdout + step.stderr)[-3000:]}
        save()
    result["log_tail"] = log.read_text()[-4000:] if log.is_file() else ""
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
