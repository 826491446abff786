"""What is alive at the gradient stage's peak: torch's allocation trace, replayed to its highest point.

    python3 benchmarks/gradient_memory_trace.py --out benchmarks/results/gradient_memory_trace_h200.json

At the calc shapes (6 synthetic trajectories of 704 tokens, NF4 Qwen3-0.6B + LoRA
r16, exact loss, the recipe's checkpointing), one warmed-up `stages.gradient.compute`
at micro-batch 6 runs under `torch.cuda.memory._record_memory_history`; the trace
is replayed allocation by allocation to the moment the bytes allocated since the
stage began peak, and every block alive then is listed with the Python frames
that allocated it (the first frames from this project, transformers, peft,
bitsandbytes, liger or torch.autograd), largest first, grouped by those frames.
CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))

KEEP = ("miniverl", "transformers", "peft", "bitsandbytes", "liger_kernel", "torch/autograd", "torch/utils/checkpoint",
        "stages/", "engine/")


def _where(frames: list[dict]) -> str:
    """The first few frames worth naming, innermost first."""
    named = [f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in frames
             if any(k in f["filename"] for k in KEEP)]
    return " < ".join(named[:4]) or (frames[0]["filename"] + ":" + str(frames[0]["line"]) if frames else "?")


def peak_blocks(trace: list[dict]) -> tuple[int, list[tuple[int, str]]]:
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in trace:
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = (size, _where(event.get("frames", [])))
            total += size
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action in ("free_requested", "free_completed") and addr in live:
            if action == "free_requested":
                total -= live.pop(addr)[0]
    return peak, sorted(at_peak.values(), reverse=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gradient_profile"))
    parser.add_argument("--micro", type=int, default=6)
    args = parser.parse_args(argv)
    import msgspec
    import torch
    import yaml

    from qwen_assets import build_assets
    from qwen_pipeline import synthetic_rollout
    from miniverl.engine.core.device import resolve_all
    from miniverl.engine.core.progress import Reporter
    from miniverl.engine.core.recipe import load_recipe
    from miniverl.engine.models.host import ModelHost
    from miniverl.stages import gradient, teacher_score

    args.work.mkdir(parents=True, exist_ok=True)
    data = yaml.safe_load((ROOT / "recipes" / "qwen_consumer_gpu_calc.yaml").read_text())
    assets = build_assets(args.work, ("calc",))
    data["models"]["student"]["path"] = str(assets["dirs"]["qwen3-0.6b"])
    data["models"]["teacher"]["path"] = str(assets["dirs"]["qwen3-1.7b"])
    data["train"]["trajectory_batch_size"] = args.micro
    data["train"]["score_batch_size"] = data["rollout"]["generation_batch_size"] = 1
    path = args.work / "trace.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    recipe, _ = load_recipe(path)
    resolved = resolve_all(recipe)
    host = ModelHost(recipe, "cuda", resolved["dtype"].value, "resident")
    host.student()
    host.teacher()
    adapter = {n: t.cpu() for n, t in host.initial_adapter().items()}
    quiet = Reporter(enabled=False)
    rollout = synthetic_rollout(host, 6, data["rollout"]["max_total_tokens"])
    _, scores = teacher_score.score(recipe, host, rollout, quiet)
    recipe = msgspec.structs.replace(recipe, loss=msgspec.structs.replace(recipe.loss, chunk_size=256))
    gradient.compute(recipe, host, rollout, scores, adapter, quiet)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    # Python stacks only, and no early stop of the checkpoint's recompute: the early stop unwinds the
    # recomputing forward by an exception, which the C++ stack capture turns into a SystemError.
    torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        gradient.compute(recipe, host, rollout, scores, adapter, quiet)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    measured_peak = torch.cuda.max_memory_allocated() - base
    trace = [e for device in snapshot["device_traces"] for e in device]
    peak, blocks = peak_blocks(trace)
    grouped: dict[str, list[int]] = {}
    for size, where in blocks:
        grouped.setdefault(where, []).append(size)
    rows = sorted(((sum(s), len(s), w) for w, s in grouped.items()), reverse=True)
    result = {"command": "python3 " + " ".join(sys.argv), "micro_batch": args.micro,
              "measured_peak_extra_bytes": measured_peak, "traced_peak_bytes": peak,
              "at_peak": [{"bytes": b, "blocks": n, "allocated_at": w} for b, n, w in rows[:40]]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"peak above the start {measured_peak / 2**20:.1f} MiB; traced {peak / 2**20:.1f} MiB")
    for b, n, w in rows[:30]:
        print(f"{b / 2**20:8.1f} MiB {n:4d}  {w}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
