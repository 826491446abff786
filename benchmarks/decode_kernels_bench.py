"""The decode kernels one group at a time, at Qwen3-0.6B's shapes: each tile configuration's time in a CUDA graph.

    python benchmarks/decode_kernels_bench.py --out benchmarks/results/decode_kernels_h200.json

For each launch of the kernel step (engine/rollout/fused_step.py) — qkv (input
RMSNorm + q, k, v), o (+ residual), gate_up (post-attention RMSNorm + gate, up,
SiLU * up), down (+ residual), LoRA r16 on every weight — and batch 1, 8, 32,
NF4 and bf16 weights: `decode_projection.project` at each way to multiply
(broadcast sums for a few rows, tensor-core dots for more) and tile (block_n,
block_k), against what the module step runs for the same group (bitsandbytes'
NF4 matmul or one stacked cuBLAS matmul per group, plus the LoRA matmuls, the
norm and the adds). Then `decode_attention` over a 704-key cache at each split
length against SDPA. Times are per call, from a CUDA graph of `--calls`
back-to-back calls replayed `--replays` times (launch gaps count as in the
decode graph); each group's `shipped` row is the launch as the decode step makes
it (`tile_config`'s tiles, x @ A.T inside the launch, K split where the tiles
say; `--shipped-only` times only those). The bandwidth fraction is the weight bytes over the time,
against the device-to-device copy bandwidth measured at the start. Rows are
written as they come (a killed run keeps what it measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform
import shlex
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from miniverl.engine.rollout.decode_attention import decode_attention
from miniverl.engine.rollout.decode_projection import (PRODUCT_BROADCAST, PRODUCT_TENSOR_CORE, SPLIT_COUNTERS, Weight,
                                                       project, stack_lora_a, tile_config)

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 1024, 3072, 16, 8, 128
# group: ([N of each weight], K, fused RMSNorm, residual, SiLU * up)
GROUPS = {
    "qkv": ([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], HIDDEN, True, False, False),
    "o": ([HIDDEN], HEADS * HEAD_DIM, False, True, False),
    "gate_up": ([INTER, INTER], HIDDEN, True, False, True),
    "down": ([HIDDEN], INTER, False, True, False),
}


def graph_us(fn, calls: int, replays: int) -> float:
    """Microseconds per call of `fn` from a CUDA graph holding `calls` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (replays * calls)


def copy_bandwidth() -> float:
    a = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = graph_us(lambda: b.copy_(a), 10, 5)
    return 2 * a.numel() / (us / 1e6)


def configs(batch: int, kind: str, tiles=None):
    """(product, block_n, block_k) to try: for NF4, broadcast sums for up to 8 rows and tensor-core dots from 8
    (a wider sweep on the H200, results/decode_kernels_h200_first_sweep.json, an earlier version of the kernel,
    never chose block_k 256 or block_n 2 for broadcast tiles); for bf16, broadcast sums at one row and
    tensor-core dots at every batch (x padded to 16 rows: the weights are the bytes read)."""
    if tiles:
        yield from tiles
        return
    if batch <= 8 and (kind == "nf4" or batch == 1):
        for block_n, block_k in itertools.product((4, 8, 16), (512, 1024)):
            yield PRODUCT_BROADCAST, block_n, block_k
    if kind == "bf16":
        for block_n, block_k in ((16, 256), (16, 512), (32, 256), (32, 512)):
            yield PRODUCT_TENSOR_CORE, block_n, block_k
    elif batch >= 8:
        for block_n, block_k in ((16, 256), (32, 256), (32, 128)):
            yield PRODUCT_TENSOR_CORE, block_n, block_k


def bench_group(name, kind, batch, args, bandwidth, rows, write):
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_functional

    widths, k, norm, residual, silu = GROUPS[name]
    gen = torch.Generator(device="cuda").manual_seed(k + batch)

    def draw(*shape, s=1.0):
        return (s * torch.randn(*shape, device="cuda", generator=gen)).to(torch.bfloat16)

    weights, modules, weight_bytes = [], [], 0
    for n in widths:
        dense, a, b = draw(n, k, s=0.02), draw(args.rank, k, s=0.02), draw(n, args.rank, s=0.02)
        a, b = (a, b) if args.rank else (None, None)
        if kind == "nf4":
            packed, state = bnb_functional.quantize_4bit(dense, blocksize=64, compress_statistics=True,
                                                         quant_type="nf4", quant_storage=torch.uint8)
            weights.append(Weight.nf4(packed, state, a, b))
            modules.append((packed, state, a, b))
            weight_bytes += packed.numel() + state.absmax.numel() + 4 * state.state2.absmax.numel()
        else:
            weights.append(Weight(n, k, dense, lora_a=a, lora_b=b))
            modules.append((dense, None, a, b))
            weight_bytes += 2 * n * k
    stacked = torch.cat([m[0] for m in modules]) if kind == "bf16" else None
    x, gamma = draw(batch, k, s=2.0), (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(torch.bfloat16)
    res = draw(batch, widths[0], s=2.0) if residual else None

    def module_step():  # the module step's ops for this group: norm, base matmul(s), LoRA, SiLU * up, residual
        h = F.rms_norm(x, (k,), gamma, 1e-6) if norm else x
        if stacked is not None:
            base = h @ stacked.t()
            outs = list(base.split(widths, dim=1))
        else:
            outs = [bnb.matmul_4bit(h, packed.t(), state) for packed, state, _, _ in modules]
        outs = [y if a is None else torch.addmm(y, h @ a.t(), b.t()) for y, (_, _, a, b) in zip(outs, modules)]
        if silu:
            return F.silu(outs[0]) * outs[1]
        y = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        return y + res if residual else y

    want = module_step().double()
    base = {"group": name, "weights": kind, "batch": batch, "k": k, "widths": widths, "weight_bytes": weight_bytes,
            "lora_rank": args.rank}
    us = graph_us(module_step, args.calls, args.replays)
    rows.append({**base, "impl": "module step", "us": us, "bw_fraction": weight_bytes / (us / 1e6) / bandwidth})
    # the launch as fused_step.decode_step makes it: tile_config's tiles, x @ A.T in the launch, K split
    stacked_a = stack_lora_a(weights) if args.rank else None
    sync, split = (torch.zeros(n, dtype=torch.int32, device="cuda") for n in (2, SPLIT_COUNTERS))

    def shipped():
        return project(x, weights, norm_weight=gamma if norm else None, residual=res, silu_mul=silu,
                       lora_a_stacked=stacked_a, lora_sync=sync, split_counters=split)

    tiles = tile_config(batch, True, kind == "bf16", silu, bool(args.rank), len(weights))
    row = {**base, "impl": "shipped", "tiles": dataclasses.asdict(tiles)}
    row["rel_err_vs_module"] = float((shipped().double() - want).norm() / want.norm())
    row["us"] = graph_us(shipped, args.calls, args.replays)
    row["bw_fraction"] = weight_bytes / (row["us"] / 1e6) / bandwidth
    rows.append(row)
    for product, block_n, block_k in [] if args.shipped_only else configs(batch, kind, args.tiles):
        for warps in args.warps:
            def call():
                return project(x, weights, norm_weight=gamma if norm else None, residual=res, silu_mul=silu,
                               block_n=block_n, block_k=block_k, product=product, num_warps=warps)

            row = {**base, "impl": "project", "product": product, "block_n": block_n, "block_k": block_k,
                   "num_warps": warps}
            try:
                row["rel_err_vs_module"] = float((call().double() - want).norm() / want.norm())
                row["us"] = graph_us(call, args.calls, args.replays)
                row["bw_fraction"] = weight_bytes / (row["us"] / 1e6) / bandwidth
            except Exception as error:  # a tile Triton cannot compile or fit: record why and go on
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            rows.append(row)
    write()


def bench_attention(batch, context, args, bandwidth, rows):
    max_len = 832
    gen = torch.Generator(device="cuda").manual_seed(batch)
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(batch, KV_HEADS, max_len, HEAD_DIM, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn_like(k)
    positions = torch.full((batch,), context - 1, device="cuda")
    mask = torch.arange(max_len, device="cuda")[None, None, None, :] <= positions[:, None, None, None]

    def sdpa():  # the module step's attention: SDPA over the whole static cache with a boolean mask
        return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=True)

    want = sdpa()[:, :, 0].double()
    cache_bytes = 2 * batch * KV_HEADS * context * HEAD_DIM * 2
    base = {"kernel": "attention", "batch": batch, "context": context, "cache_bytes": cache_bytes}
    us = graph_us(sdpa, args.calls, args.replays)
    rows.append({**base, "impl": "sdpa (module step)", "us": us, "bw_fraction": cache_bytes / (us / 1e6) / bandwidth})
    for split_len, block_l in ((32, 16), (32, 32), (64, 16), (64, 32), (128, 32)):

        def call():
            return decode_attention(q, k, v, positions, split_len=split_len, block_l=block_l)

        err = float((call().double() - want).norm() / want.norm())
        us = graph_us(call, args.calls, args.replays)
        rows.append({**base, "impl": "decode_attention", "split_len": split_len, "block_l": block_l, "us": us,
                     "bw_fraction": cache_bytes / (us / 1e6) / bandwidth, "rel_err_vs_sdpa": err})


def best(rows):
    """The fastest configuration per (group, weights, batch), beside the module step's time."""
    out = []
    keys = sorted({(r.get("group", "attention"), r.get("weights", "-"), r["batch"]) for r in rows})
    for key in keys:
        group = [r for r in rows if (r.get("group", "attention"), r.get("weights", "-"), r["batch"]) == key
                 and "us" in r]
        ours = [r for r in group if r["impl"] in ("project", "shipped", "decode_attention")]
        theirs = [r for r in group if r["impl"] in ("module step", "sdpa (module step)")]
        if ours and theirs:
            top = min(ours, key=lambda r: r["us"])
            out.append({"what": key[0], "weights": key[1], "batch": key[2], "module_step_us": theirs[0]["us"],
                        "best_us": top["us"], "speedup": theirs[0]["us"] / top["us"],
                        "best_bw_fraction": top["bw_fraction"],
                        "best": {c: top[c] for c in ("impl", "product", "block_n", "block_k", "num_warps",
                                                     "split_len", "block_l") if c in top}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_kernels_h200.json"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--weights", nargs="+", default=["nf4", "bf16"])
    parser.add_argument("--warps", type=int, nargs="+", default=[4])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--only", nargs="+", default=list(GROUPS) + ["attention"])
    parser.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank on every weight (0: none)")
    parser.add_argument("--tiles", type=lambda t: tuple(int(v) for v in t.split("/")), nargs="+",
                        help="only these product/block_n/block_k tiles (e.g. 2/8/1024 1/16/256)")
    parser.add_argument("--shipped-only", action="store_true",
                        help="time each launch only as the decode step makes it (tile_config's tiles)")
    args = parser.parse_args()
    if args.no_pdl:
        from miniverl.engine.rollout import decode_projection

        decode_projection.PDL = False
    bandwidth = copy_bandwidth()
    rows: list[dict] = []
    result = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "machine": {"gpu": torch.cuda.get_device_name(), "python": platform.python_version(),
                    "torch": torch.__version__, "cuda": torch.version.cuda,
                    "triton": __import__("triton").__version__, "bitsandbytes": __import__("bitsandbytes").__version__},
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "programmatic_dependent_launch": not args.no_pdl,
    }

    def write():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**result, "best": best(rows), "rows": rows}, indent=1) + "\n")

    for batch in args.batches:
        for kind in args.weights:
            for name in GROUPS:
                if name in args.only:
                    bench_group(name, kind, batch, args, bandwidth, rows, write)
        if "attention" in args.only:
            bench_attention(batch, 704, args, bandwidth, rows)
            write()
        for line in best([r for r in rows if r["batch"] == batch]):
            print(json.dumps(line), flush=True)
    write()
    print(f"wrote {args.out}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; {len(rows)} rows")


if __name__ == "__main__":
    main()
