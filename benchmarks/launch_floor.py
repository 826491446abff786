"""What a chain of dependent Triton launches costs by itself: the floor under a step of N launches.

    python benchmarks/launch_floor.py --out benchmarks/results/launch_floor_h200.json

The kernel decode step is 6 launches a layer, 168 for Qwen3-0.6B's 28 layers, each
waiting for the one before (fused_step.py). This times, in one captured CUDA graph,
a chain of that many launches of a kernel that does almost nothing: every program
reads the previous launch's whole output vector (`--width` float32, as a projection's
program reads all of x), sums it and writes its share of the next vector. With PDL
(programmatic dependent launch, as the step uses it) each launch starts early and waits;
without, each starts when the one before has ended. `--preload-kib` reads that many
KiB of a constant buffer a program before the wait, as the step's weight tiles are.
What a launch costs here is what the step cannot go below with that many launches,
whatever its kernels do.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from miniverl.engine.core.device import environment
from miniverl.engine.rollout.decode_projection import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_kernels_bench import graph_us  # noqa: E402


@triton.jit
def _link(prev_ptr, next_ptr, const_ptr, width, preload, PER_PROGRAM: tl.constexpr, WIDTH: tl.constexpr,
          PRELOAD: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    held = tl.zeros((PRELOAD,), dtype=tl.float32)
    if PRELOAD > 1:  # a weight tile's worth of constant bytes, read before the wait
        spots = tl.arange(0, PRELOAD)
        for i in range(0, preload, PRELOAD):
            held += tl.load(const_ptr + (pid * preload + i + spots) % (1 << 26))
    if PDL:
        gdc_wait()
    cols = tl.arange(0, WIDTH)
    x = tl.load(prev_ptr + cols, mask=cols < width, other=0.0)
    total = tl.sum(x, axis=0) * 1e-6 + tl.sum(held, axis=0) * 1e-9
    mine = pid * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    ok = mine < width
    own = tl.load(prev_ptr + mine, mask=ok, other=0.0)
    tl.store(next_ptr + mine, own * 0.5 + total, mask=ok)


def chain_us(programs: int, launches: int, width: int, preload_kib: int, pdl: bool, reps: int) -> float:
    """µs a launch of a captured chain of `launches` launches at `programs` programs each."""
    buffers = [torch.rand(width, device="cuda") for _ in range(2)]
    const = torch.rand(1 << 26, device="cuda")  # 256 MiB: the weights come from DRAM, not L2
    per_program = triton.next_power_of_2(triton.cdiv(width, programs))
    preload = preload_kib * 1024 // 4
    options = {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}

    links = itertools.count()

    def link() -> None:  # each launch reads the buffer the one before wrote
        i = next(links)
        _link[(programs,)](buffers[i % 2], buffers[(i + 1) % 2], const, width, preload, PER_PROGRAM=per_program,
                           WIDTH=triton.next_power_of_2(width), PRELOAD=min(1024, max(1, preload)), **options)

    return graph_us(link, launches, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--programs", type=int, nargs="+", default=[1, 8, 64, 132, 264, 528])
    parser.add_argument("--launches", type=int, default=168)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--preload-kib", type=int, nargs="+", default=[0, 32])
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    rows = []
    for preload_kib in args.preload_kib:
        for programs in args.programs:
            for pdl in (True, False):
                us = chain_us(programs, args.launches, args.width, preload_kib, pdl, args.reps)
                rows.append({"programs": programs, "pdl": pdl, "preload_kib": preload_kib, "us_per_launch": us,
                             "chain_ms": us * args.launches / 1000})
                print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "python " + shlex.join(sys.argv), "machine": environment(),
                                    "launches": args.launches, "width": args.width, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
