"""Bytes a cycle leaves on disk at the Qwen3 calc recipe's real shapes, with and without retention (one CUDA GPU).

    python3 benchmarks/scaling_qwen.py [--cycles 3] [--out benchmarks/results/scaling_qwen_h200.json]

Builds random-weight Qwen3-0.6B / 1.7B directories from the real configs and
tokenizer (benchmarks/qwen_assets.py), then runs recipes/qwen_consumer_gpu_calc.yaml
through the real CLI twice — with the default retention, and with every file
kept (`artifacts.keep: all`, `checkpoints.keep_every: 1`) — for a few cycles
(only `train.cycles`, `task.heldout_size` and `verify.max_new_tokens_per_turn`
are reduced; every budget that sizes a cycle's files is the shipped recipe's),
and records the bytes of each cycle directory and each checkpoint directory,
and of the run directory at the end. The computed counterpart (from the
configs alone) is in benchmarks/scaling.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen_assets import build_assets  # noqa: E402
from qwen_pipeline import ROOT, cli, environment, write_recipe  # noqa: E402

KEEP_ALL = {"artifacts.keep": "all", "checkpoints.keep_every": 1}


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def measure_run(run_dir: Path) -> dict:
    return {
        "run_dir_bytes": tree_bytes(run_dir),
        "cycle_dirs": {p.name: tree_bytes(p) for p in sorted((run_dir / "cycles").glob("*"))},
        "checkpoint_dirs": {p.name: tree_bytes(p) for p in sorted((run_dir / "checkpoints").glob("*"))},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/scaling_qwen"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scaling_qwen_h200.json")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    assets = build_assets(args.work, ("calc",))
    small, large = assets["dirs"]["qwen3-0.6b"], assets["dirs"]["qwen3-1.7b"]
    common = {"train.cycles": args.cycles, "task.heldout_size": 2, "verify.max_new_tokens_per_turn": 32,
              "models.student.path": small, "models.teacher.path": large}
    result = {"command": "python3 " + " ".join(sys.argv), "environment": environment(), "overrides": common,
              "runs": {}}
    for label, extra in (("defaults", {}), ("keep all", KEEP_ALL)):
        recipe = write_recipe("qwen_consumer_gpu_calc.yaml", {**common, **extra}, args.work / f"{label}.yaml")
        run_id = label.replace(" ", "-")
        started = time.perf_counter()
        step = cli(["run", str(recipe), "--run-id", run_id, "--runs-dir", str(args.work / "runs")],
                   args.work / "log.txt", timeout=540)
        result["runs"][label] = {"rc": step["rc"], "seconds": round(time.perf_counter() - started, 1),
                                 **measure_run(args.work / "runs" / run_id)}
        print(json.dumps({label: result["runs"][label]}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
