"""The whole kernel decode step at each tile configuration of its projections: one replayed CUDA graph each.

    python benchmarks/decode_step_sweep.py --out benchmarks/results/decode_step_sweep_h200.json

`decode_kernels_bench.py` times one launch at a time, back to back on the
same weights, so its figures are L2-warm and leave out what the launches do
to each other; this times the step itself (`StaticDecoder(kernels=True)`,
Qwen3-0.6B's shape, random weights, LoRA r16 on all seven projections, 128
prompt tokens) with every projection launch of the step taking one variant's
options (`decode_projection.project`'s product, swap, tile, stages, warps,
and whether x @ A.T is one `_lora_down` launch or done in every program).
Each row also records the greedy tokens' common prefix with the first variant
(the engine's default) over `--new-tokens` steps. Rows are written as they come.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from miniverl.engine.core.device import environment
from miniverl.engine.core.recipe import LoraSpec
from miniverl.engine.models.loading import attach_lora, load_causal_lm
from miniverl.engine.rollout import decode_projection, fused_step
from miniverl.engine.rollout.cuda_graph import StaticDecoder
from miniverl.engine.rollout.decode_attention import (COUNTERS, attend_new_token, decode_attention,
                                                      qk_norm_rope_append)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_bench import common_prefix, copy_bandwidth, engine_generate, replay_ms, save_qwen3_0_6b, step_bytes  # noqa: E402

# name: project() options for every projection launch of the step; "once": x @ A.T once for the launch (by
# `_lora_down`'s programs, leading the projection's launch where the step passes `lora_sync`), not per program;
# "module": the module-by-module step (no kernels), for reference. num_stages 1 with swap: PDL's wait after the
# first weight tile (decode_projection._tile_swapped).
VARIANTS = {
    "default": {},  # tile_config's choice for each launch
    "separate_down": {"lora_sync": None},  # the default tiles, x @ A.T by a `_lora_down` launch of its own
    # the step before the prologue moved into the split-key programs: qk_norm_rope_append, then decode_attention
    "separate_prologue": {"separate_prologue": True},
    # the attention's splits combined by the split-key launch's last program per (slot, kv head) (opt-in
    # `counters`); measured slower than the separate combine launch the step ships (session 12)
    "folded_combine": {"folded_combine": True},
    "separate_both": {"lora_sync": None, "separate_prologue": True},  # both launches back: session 7's step
    "attention_tile_32": {"attention_block_l": 32},  # the split-key programs read 32 keys a tile at any slot count
    # the split-key programs with fewer warps (fewer registers a program: room beside the qkv launch's programs
    # under PDL), or splits of 64 / 16 keys
    "attention_warps_2": {"attention_num_warps": 2},
    "attention_warps_1": {"attention_num_warps": 1},
    "attention_split_64": {"attention_split_len": 64},
    "attention_split_16": {"attention_split_len": 16, "attention_block_l": 16},
    "attention_split_16_warps_2": {"attention_split_len": 16, "attention_block_l": 16, "attention_num_warps": 2},
    "attention_split_8": {"attention_split_len": 8, "attention_block_l": 8},
    "attention_split_16_gate_up_n4": {"attention_split_len": 16, "attention_block_l": 16,
                                      "only_gate_up": {"block_n": 4}},
    # one launch kind only ("only_<kind>": qkv, gate_up): gate/up's or qkv's K split over 2 programs of 512
    # columns (at one row their 1024-wide tiles are all of K, so `split_k` alone never splits them), or
    # gate/up tiles of 4 rows (fewer registers a program: the 518 programs in one wave)
    "gate_up_split_2": {"only_gate_up": {"block_k": 512, "split_k": 2}},
    "gate_up_n4": {"only_gate_up": {"block_n": 4}},
    "qkv_split_2": {"only_qkv": {"block_k": 512, "split_k": 2}},
    "swap_a_once": {"a_per_program": False},  # swapped tiles reading x @ A.T from the launch's first programs
    "span_k": {"span_k": True},  # broadcast tiles as wide as K: o 4 x 2048, down 2 x 4096 (3072 of it used)
    "no_pair": {"pair": False},  # gate's tiles, then up's, as before session 9
    "split_2": {"split_k": 2},  # each tile's K over up to 2 programs (project(split_k=...))
    "split_4": {"split_k": 4},
    "split_8": {"split_k": 8},
    "split_4_no_pair": {"split_k": 4, "pair": False},
    "broadcast_8x1024_once": {"product": 2, "block_n": 8, "block_k": 1024, "once": True},
    "tc_16x256_once": {"product": 1, "block_n": 16, "block_k": 256, "once": True},
    "module": {"kernels": False},
    "swap_64x128_s3": {"product": 1, "swap": True, "block_n": 64, "block_k": 128, "num_stages": 3},
    "swap_64x256_s3": {"product": 1, "swap": True, "block_n": 64, "block_k": 256, "num_stages": 3},
    "swap_32x256_s3": {"product": 1, "swap": True, "block_n": 32, "block_k": 256, "num_stages": 3},
    "swap_32x128_s4": {"product": 1, "swap": True, "block_n": 32, "block_k": 128, "num_stages": 4},
    "swap_128x128_s3": {"product": 1, "swap": True, "block_n": 128, "block_k": 128, "num_stages": 3},
    "swap_64x128_s4_w8": {"product": 1, "swap": True, "block_n": 64, "block_k": 128, "num_stages": 4,
                          "num_warps": 8},
    "swap_16x256_s3": {"product": 1, "swap": True, "block_n": 16, "block_k": 256, "num_stages": 3},
    "swap_64x128_s3_once": {"product": 1, "swap": True, "block_n": 64, "block_k": 128, "num_stages": 3,
                            "once": True},
    "swap_32x256_s3_once": {"product": 1, "swap": True, "block_n": 32, "block_k": 256, "num_stages": 3,
                            "once": True},
    "swap_16x1024_s1": {"product": 1, "swap": True, "block_n": 16, "block_k": 1024, "num_stages": 1},
    "swap_16x512_s1": {"product": 1, "swap": True, "block_n": 16, "block_k": 512, "num_stages": 1},
    "swap_32x512_s1": {"product": 1, "swap": True, "block_n": 32, "block_k": 512, "num_stages": 1},
    "swap_16x1024_s1_once": {"product": 1, "swap": True, "block_n": 16, "block_k": 1024, "num_stages": 1,
                             "once": True},
    "swap_16x1024_s1_w8": {"product": 1, "swap": True, "block_n": 16, "block_k": 1024, "num_stages": 1,
                           "num_warps": 8},
    # swapped tiles with each tile's K over `split_k` programs: more programs for o_proj's and down_proj's 1024 rows
    # at a few dense rows of x. x @ A.T in every program, its K's share times B in each partial (since e4649c7);
    # `_once`: x @ A.T by the launch's first programs, added by the last (what these names measured at 03c688f)
    "swap_16x256_s3_split2": {"product": 1, "swap": True, "block_n": 16, "block_k": 256, "num_stages": 3,
                             "split_k": 2},
    "swap_16x256_s3_split4": {"product": 1, "swap": True, "block_n": 16, "block_k": 256, "num_stages": 3,
                             "split_k": 4},
    "swap_32x256_s3_split2": {"product": 1, "swap": True, "block_n": 32, "block_k": 256, "num_stages": 3,
                             "split_k": 2},
    "swap_32x256_s3_split4": {"product": 1, "swap": True, "block_n": 32, "block_k": 256, "num_stages": 3,
                             "split_k": 4},
    "swap_64x256_s3_split2": {"product": 1, "swap": True, "block_n": 64, "block_k": 256, "num_stages": 3,
                             "split_k": 2},
    "swap_64x256_s3_split4": {"product": 1, "swap": True, "block_n": 64, "block_k": 256, "num_stages": 3,
                             "split_k": 4},
    "swap_32x256_s3_split2_once": {"product": 1, "swap": True, "block_n": 32, "block_k": 256, "num_stages": 3,
                                  "split_k": 2, "once": True},
    "swap_64x256_s3_split2_once": {"product": 1, "swap": True, "block_n": 64, "block_k": 256, "num_stages": 3,
                                  "split_k": 2, "once": True},
    "swap_64x256_s3_split3": {"product": 1, "swap": True, "block_n": 64, "block_k": 256, "num_stages": 3,
                             "split_k": 3},
    "swap_64x128_s4_split2": {"product": 1, "swap": True, "block_n": 64, "block_k": 128, "num_stages": 4,
                             "split_k": 2},
    # broadcast tiles narrower or shorter, K split, x @ A.T once (the launch's first programs); 8 x 1024 split 4
    # was NF4's tile at 2-8 rows before 822bd7a (4 x 1024 since), here for dense weights past one row too
    "bcast_8x1024_split4": {"product": 2, "block_n": 8, "block_k": 1024, "split_k": 4, "once": True},
    "bcast_4x1024_split4": {"product": 2, "block_n": 4, "block_k": 1024, "split_k": 4, "once": True},
    "bcast_8x512_split4": {"product": 2, "block_n": 8, "block_k": 512, "split_k": 4, "once": True},
    "bcast_4x512_split8": {"product": 2, "block_n": 4, "block_k": 512, "split_k": 8, "once": True},
    "bcast_2x1024_split4": {"product": 2, "block_n": 2, "block_k": 1024, "split_k": 4, "once": True},
    # tile_config's tiles, its broadcast products over several rows summed over K for every row at once
    # (PRODUCT_BROADCAST_AT_ONCE): fewer cross-warp reductions than one row at a time (session 14)
    "at_once": {"broadcast": 3},
    # the same for NF4 (only: they name the tiles of every launch) with 8-row tiles, or 8 warps (session 15)
    "at_once_n8": {"broadcast": 3, "block_n": 8},
    "at_once_w8": {"broadcast": 3, "num_warps": 8},
    # every broadcast product over several rows one row at a time (PRODUCT_BROADCAST): the tiles before session 15
    "one_row": {"broadcast": 2},
    # bf16 rounded by its bit arithmetic in the compiled kernels too (DTYPE 0), as before session 16
    "bit_rounding": {"bit_rounding": True},
    # one launch kind's tiles at a time (session 16, dense weights past four rows): swapped 16 x 256 tiles (twice
    # the programs), swapped 32 x 128 over 4 stages, the shipped tiles with K over 2 programs (`_tiles_split_2`,
    # `<kind>_split_2` in session 17's results, which held these options), or broadcast sums of every row at
    # once (8- or 4-row tiles, K over up to 4 programs, x @ A.T by the launch's first programs)
    "qkv_swap_16x256": {"only_qkv": {"product": 1, "swap": True, "block_n": 16, "block_k": 256, "num_stages": 3, "a_per_program": True}},
    "qkv_swap_32x128_s4": {"only_qkv": {"product": 1, "swap": True, "block_n": 32, "block_k": 128, "num_stages": 4, "a_per_program": True}},
    "qkv_tiles_split_2": {"only_qkv": {"split_k": 2}},
    "qkv_at_once_8": {"only_qkv": {"product": 3, "swap": False, "block_n": 8, "block_k": 1024, "split_k": 4, "a_per_program": False}},
    "qkv_at_once_4": {"only_qkv": {"product": 3, "swap": False, "block_n": 4, "block_k": 1024, "split_k": 4, "a_per_program": False}},
    "o_swap_16x256": {"only_o": {"product": 1, "swap": True, "block_n": 16, "block_k": 256, "num_stages": 3, "a_per_program": True}},
    "o_swap_32x128_s4": {"only_o": {"product": 1, "swap": True, "block_n": 32, "block_k": 128, "num_stages": 4, "a_per_program": True}},
    "o_tiles_split_2": {"only_o": {"split_k": 2}},
    "o_at_once_8": {"only_o": {"product": 3, "swap": False, "block_n": 8, "block_k": 1024, "split_k": 4, "a_per_program": False}},
    "o_at_once_4": {"only_o": {"product": 3, "swap": False, "block_n": 4, "block_k": 1024, "split_k": 4, "a_per_program": False}},
    "gate_up_swap_16x256": {"only_gate_up": {"product": 1, "swap": True, "block_n": 16, "block_k": 256, "num_stages": 3, "a_per_program": True}},
    "gate_up_swap_32x128_s4": {"only_gate_up": {"product": 1, "swap": True, "block_n": 32, "block_k": 128, "num_stages": 4, "a_per_program": True}},
    "gate_up_tiles_split_2": {"only_gate_up": {"split_k": 2}},
    "gate_up_at_once_8": {"only_gate_up": {"product": 3, "swap": False, "block_n": 8, "block_k": 1024, "split_k": 4, "a_per_program": False}},
    "gate_up_at_once_4": {"only_gate_up": {"product": 3, "swap": False, "block_n": 4, "block_k": 1024, "split_k": 4, "a_per_program": False}},
    "down_swap_16x256": {"only_down": {"product": 1, "swap": True, "block_n": 16, "block_k": 256, "num_stages": 3, "a_per_program": True}},
    "down_swap_32x128_s4": {"only_down": {"product": 1, "swap": True, "block_n": 32, "block_k": 128, "num_stages": 4, "a_per_program": True}},
    "down_tiles_split_2": {"only_down": {"split_k": 2}},
    "down_at_once_8": {"only_down": {"product": 3, "swap": False, "block_n": 8, "block_k": 1024, "split_k": 4, "a_per_program": False}},
    "down_at_once_4": {"only_down": {"product": 3, "swap": False, "block_n": 4, "block_k": 1024, "split_k": 4, "a_per_program": False}},
    "gate_up_tiles_split_4": {"only_gate_up": {"split_k": 4}},
    # session 19: x @ A.T in every program of the broadcast tiles (no chain from the launch's first programs)
    "a_per_program": {"a_per_program": True},
    "a_per_program_n16": {"a_per_program": True, "block_n": 16},
    "a_per_program_n4": {"a_per_program": True, "block_n": 4},
    "a_per_program_w8": {"a_per_program": True, "num_warps": 8},
    # session 19: registers capped so that a launch's programs fit the SMs in one wave (or leave room for the
    # next launch's programs to read their weights before PDL's wait)
    "qkv_regs_128": {"only_qkv": {"max_registers": 128}},
    "gate_up_regs_128": {"only_gate_up": {"max_registers": 128}},
    "gate_up_regs_80": {"only_gate_up": {"max_registers": 80}},
    "gate_up_n8": {"only_gate_up": {"block_n": 8}},
    "gate_up_n8_regs_168": {"only_gate_up": {"block_n": 8, "max_registers": 168}},
    "o_down_regs_96": {"only_o": {"max_registers": 96}, "only_down": {"max_registers": 96}},
    "regs_128": {"max_registers": 128},
    "nf4_one_wave": {"only_qkv": {"max_registers": 128}, "only_gate_up": {"block_n": 8, "max_registers": 168}},
    "n16": {"block_n": 16},
    "w8": {"num_warps": 8},
    # o's and down's K in one program (their broadcast tiles split it over up to 4 by default)
    "o_tiles_split_1": {"only_o": {"split_k": 1}},
    "down_tiles_split_1": {"only_down": {"split_k": 1}},
    # dense weights with an adapter at 5-8 rows as before session 17: o, gate and up, down in swapped 32 x 256
    # tiles, x @ A.T in every program, K not split (qkv's tiles did not change)
    "swapped_5_8": {f"only_{kind}": {"product": 1, "swap": True, "block_n": 32, "block_k": 256, "num_stages": 3,
                                     "a_per_program": True, "split_k": 1, "pair": False}
                    for kind in ("o", "gate_up", "down")},
}
DEFAULT_VARIANTS = ["default", "module", "separate_down", "broadcast_8x1024_once", "tc_16x256_once",
                    "swap_32x256_s3", "swap_16x256_s3", "swap_64x256_s3", "swap_16x512_s1"]


def patched_project(original, options: dict, intermediate: int):
    """fused_step's `project` with the variant's options on every launch (per-launch arguments kept); a
    variant that names its tiles computes x @ A.T in every program unless it says `once`. `only_<kind>`
    options go to one launch kind (qkv, o, gate_up, down: down_proj's K is the model's intermediate size)."""
    options = dict(options)
    if "product" in options:
        options["a_per_program"] = not options.pop("once", False)
        options.setdefault("swap", False)

    only = {kind: options.pop(f"only_{kind}", {}) for kind in ("qkv", "o", "gate_up", "down")}
    broadcast = options.pop("broadcast", None)

    def project(x, weights, **kwargs):
        kind = ("gate_up" if kwargs.get("silu_mul") else "qkv" if len(weights) == 3
                else "down" if weights[0].k == intermediate else "o")
        tiles = {} if broadcast is None else broadcast_tiles(x, weights, kwargs.get("silu_mul", False), broadcast)
        return original(x, weights, **{**kwargs, **tiles, **options, **only.get(kind, {})})
    return project


def broadcast_tiles(x, weights, silu_mul: bool, product: int) -> dict:
    """`tile_config`'s tiles for the launch as `project` arguments (a launch naming its product names every
    field), with its broadcast product over more than one row of x replaced by `product` (one row at a time or
    every row at once); nothing for other launches."""
    from miniverl.engine.rollout.decode_projection import (PRODUCT_BROADCAST, PRODUCT_BROADCAST_AT_ONCE,
                                                           tile_config)
    tiles = tile_config(x.shape[0], x.is_cuda, weights[0].dense, silu_mul, weights[0].lora_a is not None,
                        len(weights))
    if tiles.product not in (PRODUCT_BROADCAST, PRODUCT_BROADCAST_AT_ONCE) or x.shape[0] == 1:
        return {}
    return dataclasses.asdict(dataclasses.replace(tiles, product=product))


def two_launch_attention(qkv, q_weight, k_weight, eps, cos, sin, positions, k_cache, v_cache):
    """`attend_new_token` as the step took it before session 8: its prologue and its combine as launches of their
    own."""
    q = qk_norm_rope_append(qkv, q_weight, k_weight, eps, cos, sin, positions, k_cache, v_cache)
    return decode_attention(q, k_cache, v_cache, positions)


def folded_combine(counters: torch.Tensor):
    """`attend_new_token` with the combine in the split-key launch; every launch re-zeroes the counters it used,
    so one tensor serves every layer."""
    return functools.partial(attend_new_token, counters=counters)


def bench(model, label: str, slots: int, variants: list[str], args, bandwidth: float, dense_copy: bool) -> list[dict]:
    gen = torch.Generator().manual_seed(slots)
    prompts = torch.randint(0, 151936, (slots, args.prompt_tokens), generator=gen).tolist()
    bytes_step = step_bytes(model, slots, args.prompt_tokens + args.new_tokens / 2)
    original, rows, reference = fused_step.project, [], None
    for name in variants:
        row = {"weights": label, "slots": slots, "variant": name, "options": VARIANTS[name]}
        options = dict(VARIANTS[name])
        kernels = options.pop("kernels", True)
        if options.pop("separate_prologue", False):
            fused_step.attend_new_token = two_launch_attention
        if options.pop("bit_rounding", False):
            decode_projection.HARDWARE_BF16_ROUNDING = False
        if options.pop("folded_combine", False):
            fused_step.attend_new_token = folded_combine(torch.zeros(COUNTERS, dtype=torch.int32, device="cuda"))
        attention = {key.removeprefix("attention_"): options.pop(key) for key in list(options)
                     if key.startswith("attention_")}
        if attention:
            fused_step.attend_new_token = functools.partial(attend_new_token, **attention)
        fused_step.project = patched_project(original, options, model.config.intermediate_size)
        try:
            start = time.perf_counter()
            decoder = StaticDecoder(model, slots, args.prompt_tokens + args.new_tokens, use_graph=True,
                                    kernels=kernels, dense_copy=dense_copy)
            engine_generate(decoder, prompts, 4)  # compile and capture
            row["setup_s"] = time.perf_counter() - start
            tokens = engine_generate(decoder, prompts, args.new_tokens)
            row["mode"] = decoder.mode
            row["step_ms"] = statistics.median(replay_ms(decoder) for _ in range(5))
            row["bw_fraction"] = bytes_step / (row["step_ms"] / 1e3) / bandwidth
            if reference is None:
                reference = tokens
            row["greedy_common_prefix_mean"] = statistics.mean(
                common_prefix(a, b) for a, b in zip(reference, tokens))
            del decoder
        except Exception as exc:  # noqa: BLE001 - keep the other variants
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            fused_step.project, fused_step.attend_new_token = original, attend_new_token
            decode_projection.HARDWARE_BF16_ROUNDING = True
            torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--weights", nargs="+", default=["bf16", "nf4", "nf4_dense_copy"])
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    parser.add_argument("--lora-rank", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_step_sweep needs a CUDA device")
    result = {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
              "machine": {"host": platform.node(), **environment()},
              "copy_bandwidth_TBps": copy_bandwidth() / 1e12, "rows": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        save_qwen3_0_6b(Path(tmp), seed=0)
        models = {}
        for label in args.weights:
            nf4 = label.startswith("nf4")
            if nf4 not in models:
                models.clear()
                torch.cuda.empty_cache()
                models[nf4] = attach_lora(load_causal_lm(Path(tmp), torch.bfloat16, "cuda", nf4=nf4),
                                          LoraSpec(r=args.lora_rank, alpha=2.0 * args.lora_rank), seed=0)
            for slots in args.slots:
                result["rows"] += bench(models[nf4], label, slots, args.variants, args,
                                        result["copy_bandwidth_TBps"] * 1e12, dense_copy=label.endswith("dense_copy"))
                args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
