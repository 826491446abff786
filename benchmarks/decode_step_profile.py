"""Where the kernel decode step's time goes: every kernel of one replayed CUDA graph, by its place in a layer.

    python benchmarks/decode_step_profile.py --out benchmarks/results/decode_step_profile_h200.json

`decode_step_sweep.py` times whole steps; this replays the same step
(`StaticDecoder(kernels=True)`, Qwen3-0.6B's shape, random weights, LoRA r16
on all seven projections) under torch.profiler and reads each kernel's start
and end from the trace. Under programmatic dependent launch a kernel starts
before its predecessor ends and waits inside, so a kernel's own duration says
little; what each kernel adds to the step is its end minus the end of the
kernel before it (`adds_us`), summed here over the 28 layers by the kernel's
place in the layer (qkv, attention, combine, o, gate_up, down), plus what
comes before the first layer and after the last.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from miniverl.engine.core.device import environment
from miniverl.engine.core.recipe import LoraSpec
from miniverl.engine.models.loading import attach_lora, load_causal_lm
from miniverl.engine.rollout.cuda_graph import StaticDecoder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_bench import engine_generate, replay_ms, save_qwen3_0_6b  # noqa: E402

LAYER = ["qkv", "attention", "combine", "o", "gate_up", "down"]  # fused_step.decode_step's launches in order


def kernel_rows(trace: Path) -> list[dict]:
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    return sorted(({"name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"]), "args": e.get("args", {})}
                   for e in kernels), key=lambda e: e["ts"])


SHAPE_ARGS = ("grid", "block", "registers per thread", "shared memory", "blocks per SM", "warps per SM",
              "est. achieved occupancy %")


def launch_shape(kernel: dict, props) -> dict:
    """The launch's shape as the profiler records it, with `resident_per_sm` (the programs an SM holds at once by
    their registers, threads and shared memory) and `waves` (its programs over what all SMs hold): past one wave,
    later programs start only when earlier ones finish, so they cannot read their weights before PDL's wait."""
    args = kernel["args"]
    shape = {key: args[key] for key in SHAPE_ARGS if key in args}
    grid, block, regs = args.get("grid"), args.get("block"), args.get("registers per thread")
    if grid and block and regs:
        threads = block[0] * block[1] * block[2]
        warp_regs = -(-regs * 32 // 256) * 256  # registers are allocated a warp at a time, 256 at a time
        by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (warp_regs * (-(-threads // 32)))
        by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads
        shared = args.get("shared memory", 0)
        by_shared = getattr(props, "shared_memory_per_multiprocessor", 233472) // shared if shared else by_threads
        resident = min(by_regs, by_threads, by_shared, 32)
        programs = grid[0] * grid[1] * grid[2]
        shape.update(programs=programs, resident_per_sm=resident,
                     waves=programs / (props.multi_processor_count * resident) if resident else None)
    return shape


def split_steps(kernels: list[dict], per_step: int) -> list[list[dict]]:
    return [kernels[i:i + per_step] for i in range(0, len(kernels) - per_step + 1, per_step)]


def attribute(step: list[dict], layers: int) -> dict:
    """Per place in a layer: summed duration and summed end-to-end increment (us) over the layers."""
    first = next(i for i, k in enumerate(step) if k["name"].startswith("_project"))
    out = {"before_us": step[first - 1]["ts"] + step[first - 1]["dur"] - step[0]["ts"] if first else 0.0,
           "step_us": step[-1]["ts"] + step[-1]["dur"] - step[0]["ts"]}
    places = {p: {"dur_us": 0.0, "adds_us": 0.0, "start_gap_us": 0.0} for p in LAYER}
    prev_end = step[first - 1]["ts"] + step[first - 1]["dur"] if first else step[0]["ts"]
    for index in range(layers * len(LAYER)):
        k = step[first + index]
        place = places[LAYER[index % len(LAYER)]]
        end = k["ts"] + k["dur"]
        place["dur_us"] += k["dur"]
        place["adds_us"] += end - prev_end
        place["start_gap_us"] += k["ts"] - prev_end
        prev_end = end
    out["places"] = places
    out["after_us"] = step[-1]["ts"] + step[-1]["dur"] - prev_end
    out["after_kernels"] = [k["name"][:60] for k in step[first + layers * len(LAYER):]]
    out["before_kernels"] = [k["name"][:60] for k in step[:first]]
    out["names"] = sorted({k["name"][:80] for k in step[first:first + len(LAYER)]})
    props = torch.cuda.get_device_properties(0)
    out["first_layer_shapes"] = {place: launch_shape(step[first + i], props) for i, place in enumerate(LAYER)}
    return out


def profile(decoder: StaticDecoder, reps: int, tmp: Path, label: str) -> dict:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            decoder.graph.replay()
        torch.cuda.synchronize()
    trace = tmp / f"{label}.json"
    prof.export_chrome_trace(str(trace))
    kernels = kernel_rows(trace)
    per_step = len(kernels) // reps
    layers = len(decoder.fused)
    steps = [attribute(s, layers) for s in split_steps(kernels, per_step)][1:]  # the first is warm-up
    place_mean = {p: {key: statistics.median(s["places"][p][key] for s in steps) for key in steps[0]["places"][p]}
                  for p in LAYER}
    return {"kernels_per_step": per_step, "steps_profiled": len(steps),
            "step_us_median": statistics.median(s["step_us"] for s in steps),
            "before_us": statistics.median(s["before_us"] for s in steps),
            "after_us": statistics.median(s["after_us"] for s in steps),
            "places_us_over_layers": place_mean, "before_kernels": steps[0]["before_kernels"],
            "after_kernels": steps[0]["after_kernels"], "layer_kernel_names": steps[0]["names"],
            "first_layer_shapes": steps[0]["first_layer_shapes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--weights", nargs="+", default=["bf16", "bf16_rank0", "nf4", "nf4_dense_copy"])
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--replay-only", action="store_true",
                        help="replay the graphs without torch.profiler (for running under Nsight Compute)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_step_profile needs a CUDA device")
    result = {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
              "machine": {"host": platform.node(), **environment()}, "rows": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        save_qwen3_0_6b(tmp / "model", seed=0)
        for label in args.weights:
            nf4 = label.startswith("nf4")
            model = load_causal_lm(tmp / "model", torch.bfloat16, "cuda", nf4=nf4)
            if not label.endswith("rank0"):
                model = attach_lora(model, LoraSpec(r=args.lora_rank, alpha=2.0 * args.lora_rank), seed=0)
            for slots in args.slots:
                prompts = torch.randint(0, 151936, (slots, 128), generator=torch.Generator().manual_seed(0)).tolist()
                decoder = StaticDecoder(model, slots, 192, use_graph=True, kernels=True,
                                        dense_copy=label.endswith("dense_copy"))
                engine_generate(decoder, prompts, 8)  # compile and capture
                row = {"weights": label, "slots": slots,
                       "replay_ms": statistics.median(replay_ms(decoder, 2 if args.replay_only else 50)
                                                      for _ in range(1 if args.replay_only else 5))}
                if not args.replay_only:
                    row.update(profile(decoder, args.reps, tmp, f"{label}_{slots}"))
                print(json.dumps(row), flush=True)
                result["rows"].append(row)
                args.out.write_text(json.dumps(result, indent=2))
                del decoder
                torch.cuda.empty_cache()
            del model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
