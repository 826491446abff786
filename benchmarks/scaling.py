"""Does a run's disk use or bookkeeping grow with its number of cycles?

    python benchmarks/scaling.py [--cycles 50 500 5000] [--keep-all-cycles 50 500] [--out FILE]

Runs the tiny calculator recipe shrunk to the least work a cycle can do (one
rollout of a few tokens, one held-out item), in-process, for each number of
cycles: with the default retention, and (for the smaller counts) with every
file kept (`artifacts.keep: all`, `checkpoints.keep_every: 1`), the behaviour
before retention existed. For each run it records the run directory's bytes
and files at the end, and the driver's bookkeeping time per stage — the
journal appends and snapshots, the events, the done checks and the retention
passes, i.e. everything the driver does around a stage except the stage's own
work and the writes of its outputs — for the first and the last tenth of the
cycles.

It also computes the bytes one cycle writes at the shapes of
recipes/qwen_consumer_gpu_calc.yaml from the real Qwen3 configs
(tests/fixtures/qwen3), term by term: what retention keeps flat.

Result: benchmarks/results/scaling_cpu.json (and .md).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SMALLEST = {  # one rollout of a few tokens a cycle, one held-out item: the cycle is all bookkeeping it can be
    "train.rollouts_per_cycle": 1, "train.trajectory_batch_size": 1, "rollout.generation_batch_size": 1,
    "rollout.max_turns": 1, "rollout.max_new_tokens_per_turn": 4, "rollout.max_total_tokens": 96,
    "task.heldout_size": 1, "verify.batch_size": 1, "verify.max_new_tokens_per_turn": 4, "models.device": "cpu",
}
KEEP_ALL = {"artifacts.keep": "all", "checkpoints.keep_every": 1}


class Bookkeeping:
    """Seconds the driver spends around each stage, by the cycle the stage belongs to."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds: dict[int, float] = defaultdict(float)
        self.stages: dict[int, int] = defaultdict(int)
        self.cycle = -1

    def timed(self, function):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[self.cycle] += time.perf_counter() - started
        return wrapper

    def install(self) -> None:
        from miniverl.engine.core.rundir import RunDir
        from miniverl.engine.run import driver, retention

        for owner, name in ((RunDir, "record"), (RunDir, "event"), (driver.Driver, "is_done"),
                            (retention.Retention, "after_step"), (retention.Retention, "sweep")):
            setattr(owner, name, self.timed(getattr(owner, name)))
        execute = driver.Driver.execute

        def tracked(this, key):
            self.cycle = key.cycle if key.cycle is not None else -1
            self.stages[self.cycle] += 1
            return execute(this, key)
        driver.Driver.execute = tracked

    def per_stage_ms(self, cycles: range) -> float:
        seconds = sum(self.seconds[c] for c in cycles)
        stages = sum(self.stages[c] for c in cycles)
        return 1000 * seconds / max(stages, 1)


BOOK = Bookkeeping()


def directory_size(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def run_once(cycles: int, keep_all: bool, work: Path) -> dict:
    from support import recipe_dict

    from miniverl.engine.core.progress import Reporter
    from miniverl.engine.run.commands import start_run

    overrides = {**SMALLEST, "train.cycles": cycles, **(KEEP_ALL if keep_all else {})}
    recipe = work / f"scaling-{cycles}-{keep_all}.yaml"
    recipe.write_text(yaml.safe_dump(recipe_dict(**overrides)))
    book = BOOK
    book.reset()
    started = time.perf_counter()
    run = start_run(recipe, f"c{cycles}", work / ("keep-all" if keep_all else "default"), Reporter(enabled=False))
    wall = time.perf_counter() - started
    total, files = directory_size(run.root)
    tenth = max(cycles // 10, 1)
    journal = {name: (run.root / name).stat().st_size for name in ("journal.msgpack", "journal.log")}
    return {
        "cycles": cycles, "retention": "keep all" if keep_all else "defaults", "wall_seconds": round(wall, 1),
        "run_dir_bytes": total, "run_dir_files": files,
        "artifact_bytes": sum(p.stat().st_size for sub in ("cycles", "checkpoints") if (run.root / sub).exists()
                              for p in (run.root / sub).rglob("*") if p.is_file()),
        "journal_bytes": journal, "events_bytes": (run.root / "events.jsonl").stat().st_size,
        "bookkeeping_ms_per_stage_first_tenth": round(book.per_stage_ms(range(0, tenth)), 3),
        "bookkeeping_ms_per_stage_last_tenth": round(book.per_stage_ms(range(cycles - tenth, cycles)), 3),
    }


def qwen_cycle_bytes() -> dict:
    """Bytes one cycle writes at the calc recipe's shapes, from the real configs (the terms retention bounds)."""
    from miniverl.engine.core.recipe import parse_recipe
    from miniverl.engine.models.memory_estimate import lora_parameters, model_shape

    recipe = parse_recipe((ROOT / "recipes" / "qwen_consumer_gpu_calc.yaml").read_text())
    fixtures = ROOT / "tests" / "fixtures" / "qwen3"
    student = model_shape(json.loads((fixtures / "config-Qwen3-0.6B.json").read_text()))
    teacher = model_shape(json.loads((fixtures / "config-Qwen3-1.7B.json").read_text()))
    lora = lora_parameters(student, recipe.models.student.lora.target_modules, recipe.models.student.lora.r)
    positions = recipe.train.rollouts_per_cycle * recipe.rollout.max_total_tokens  # every trajectory at its budget
    terms = {
        "adapter (fp32)": 4 * lora,
        "optimizer state (paged 8-bit AdamW: two uint8 moments + fp32 absmax per 256)": lora * (2 + 2 * 4 / 256),
        "gradient (fp32)": 4 * lora,
        "teacher scores (exact mode: bf16 final hidden states at every position)": 2 * teacher.hidden * positions,
        "rollout (token ids, provenance, log-probs; about 16 B a token)": 16 * positions,
    }
    per_cycle = sum(terms.values())
    checkpoint = terms["adapter (fp32)"] + terms[next(k for k in terms if k.startswith("optimizer"))]
    kept_defaults = 2 * checkpoint + (per_cycle - checkpoint)  # keep_last 2, and the last cycle's own files
    return {"lora_parameters": lora, "positions_per_cycle": positions, "terms_bytes": {k: int(v) for k, v in terms.items()},
            "bytes_per_cycle_without_retention": int(per_cycle),
            "bytes_kept_with_defaults_at_any_cycle": int(kept_defaults),
            "gb_for_1000_cycles_without_retention": round(per_cycle * 1000 / 1e9, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, nargs="+", default=[50, 500, 5000])
    parser.add_argument("--keep-all-cycles", type=int, nargs="*", default=[50, 500])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scaling_cpu.json")
    args = parser.parse_args()
    import torch

    from miniverl.engine.run.commands import quiet_libraries

    quiet_libraries()
    torch.set_num_threads(1)
    BOOK.install()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for cycles, keep_all in [(n, False) for n in args.cycles] + [(n, True) for n in args.keep_all_cycles]:
            result = run_once(cycles, keep_all, Path(tmp))
            print(json.dumps(result), flush=True)
            runs.append(result)
    document = {
        "command": "python benchmarks/scaling.py " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "recipe": "recipes/tiny_calc.yaml with " + json.dumps(SMALLEST),
        "runs": runs,
        "qwen_calc_cycle": qwen_cycle_bytes(),
    }
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
