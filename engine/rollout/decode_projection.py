"""A decoder layer's projections for a few tokens, one Triton kernel per group: NF4 or bf16 weights, LoRA inside.

The decode step (fused_step.py) reads every weight once per token, so its
speed is the weight bytes over the memory bandwidth, plus one launch per
kernel. This module gives it one kernel, launched four times a layer for the
seven linears:

- `project(x, [q, k, v], norm=...)`: the input RMSNorm, then q, k and v side by
  side into one [B, Nq + Nk + Nv] output (each program takes BLOCK_N rows of
  one of the three weights);
- `project(x, [o], residual=h)` and `project(act, [down], residual=h)`: one
  weight with the residual added;
- `project(x, [gate, up], norm=..., silu_mul=True)`: the post-attention
  RMSNorm, both weights for the same rows, SiLU(gate) * up in the epilogue.

A weight (`Weight.of(base_layer, A, B)`) is the very tensor the training step
uses: bitsandbytes' packed NF4 codes with their (double-quantized) absmax, read
and dequantized in registers (no second copy, no re-quantization), or a dense
bf16/fp16/fp32 matrix. The LoRA adapter's x @ A.T accumulates along K beside the
product and meets B (already scaled by alpha / r) in the epilogue.

bitsandbytes' NF4 layout, for a [N, K] weight flattened row-major: byte i
holds element 2i in its high nibble and 2i+1 in its low one; each nibble
indexes the 16-entry NF4 code; every 64 elements share one absmax. With
double quantization each absmax is a uint8 into a 256-entry code, scaled by a
float32 per 256 absmaxes, plus an offset:

    W[e] = code[nibble(e)] * absmax(e // 64)
    absmax(a) = code2[absmax_u8[a]] * absmax2[a // 256] + offset      (nested)

Each program walks K in BLOCK_K steps; an NF4 tile's nibbles are decoded
with one absmax per 64-element block and interleaved back into columns. Weights are rounded to x's dtype as bitsandbytes'
dequantize rounds them, a fused RMSNorm rounds as Qwen3RMSNorm does, and the
products are summed in float32: on a GPU by half-precision tensor-core dots
(exact products of operands already at that precision), in Triton's CPU
interpreter (which has no half-precision dot) by float32 ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

try:  # programmatic dependent launch (Hopper and later; Triton >= 3.5): see `launch_options`
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older Triton: the kernels launch without it
    gdc_launch_dependents = gdc_wait = None

QUANT_BLOCK = 64  # elements per absmax: the only NF4 block size read here
NESTED_BLOCK = 256  # absmaxes per second-level scale (bitsandbytes' double quantization)
PRODUCT_DOT32, PRODUCT_TENSOR_CORE, PRODUCT_BROADCAST, PRODUCT_BROADCAST_AT_ONCE = 0, 1, 2, 3
SPAN_K_MAX = 4096  # the widest broadcast tile `project(span_k=True)` takes
SPLIT_COUNTERS = 4096  # `project(split_counters=...)` entries a call site allocates: tiles x blocks of rows


def dtype_code(dtype: torch.dtype, device: torch.device | None = None) -> int:
    """The kernels' DTYPE: 0 bf16 rounded by its bits, 1 fp16, 2 fp32 (float32 models: the reference the greedy
    tests compare to), 3 bf16 rounded by the GPU's own conversion (a compiled kernel on `device`, CUDA)."""
    codes = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
    if dtype not in codes:
        raise ValueError(f"the decode kernels compute in bf16, fp16 or fp32; got {dtype}")
    if codes[dtype] == 0 and device is not None and device.type == "cuda" and HARDWARE_BF16_ROUNDING \
            and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return 3
    return codes[dtype]


# The compiled kernels round float32 to bf16 by the conversion instruction (cvt.rn: to nearest, ties to even,
# the bit arithmetic's result bit for bit; NF4 qkv at 8 rows compiles to 13% fewer instructions): the replayed
# step at 1 and 8 slots 0.965 and 1.900 ms against 0.989 and 2.057 (bf16), NF4 1.133 and 2.448 against 1.189 and
# 2.685 (one H100, session 17). False: the bit arithmetic everywhere, for the sweep to compare.
HARDWARE_BF16_ROUNDING = True


PDL: bool | None = None  # None: where the device and Triton support it; the benchmarks set False to compare


def launch_options(device: torch.device) -> dict:
    """Triton launch options for the decode kernels on `device`: programmatic dependent launch where supported.

    With PDL a kernel may start while the one before it finishes: each decode kernel first lets its successor
    launch (`gdc_launch_dependents`), loads what no earlier kernel writes (its weights), and waits for its
    predecessor (`gdc_wait`) before reading activations or writing anything. Every kernel waits, so each
    one's wait also covers the kernels before its predecessor. Inside a captured CUDA graph the launches become
    programmatic edges, so the step's launch gaps overlap with the weight reads.
    """
    if device.type != "cuda" or gdc_wait is None:
        return {"PDL": False}
    enabled = torch.cuda.get_device_capability(device)[0] >= 9 if PDL is None else PDL
    return {"PDL": True, "launch_pdl": True} if enabled else {"PDL": False}


@triton.jit
def round_to_dtype(v, DTYPE: tl.constexpr):
    """float32 v rounded to the compute dtype (to nearest, ties to even) and back; bf16 by its bits (DTYPE 0),
    since Triton's CPU interpreter truncates a bf16 cast where the GPU rounds, or by that cast (3: on a GPU)."""
    if DTYPE == 3:
        return v.to(tl.bfloat16).to(tl.float32)
    elif DTYPE == 0:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == 1:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def _product(x, w, PRODUCT: tl.constexpr, DTYPE: tl.constexpr):
    """x [B, K] @ w [N, K].T in float32. 0: float32 dot (IEEE); 1: half-precision tensor-core dot with a float32
    accumulator, exact for operands already rounded to that precision; 2: broadcast multiply and sum (no dot, so
    no 16-row minimum), one row of x at a time; 3: the same over [B, N, K] at once, so that every row's sums over
    K share one reduction (one row at a time, each row's crosses the warps on its own: NF4 gate/up at 8 rows
    compiles to 194 barriers, 62 at once, session 14)."""
    if PRODUCT == 1:
        half = tl.bfloat16 if DTYPE == 0 or DTYPE == 3 else tl.float16
        return tl.dot(x.to(half), tl.trans(w.to(half)))
    elif PRODUCT == 3:
        return tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    elif PRODUCT == 2:  # one row of x at a time: the tile stays [N, K] in registers, whatever the batch
        rows = tl.arange(0, x.shape[0])[:, None]
        out = tl.zeros((x.shape[0], w.shape[0]), dtype=tl.float32)
        for b in tl.static_range(x.shape[0]):
            x_row = tl.sum(tl.where(rows == b, x, 0.0), axis=0)
            out = tl.where(rows == b, tl.sum(w * x_row[None, :], axis=1)[None, :], out)
        return out
    else:
        return tl.dot(x, tl.trans(w), input_precision="ieee")


@triton.jit
def _inverse_rms(x_base, batch_ok, K, eps, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):
    """RMSNorm's 1 / rms of each row of x, in float32."""
    squares = tl.zeros((BLOCK_B,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_base + cols[None, :], mask=batch_ok[:, None] & (cols[None, :] < K), other=0.0).to(tl.float32)
        squares += tl.sum(v * v, axis=1)
    return 1.0 / tl.sqrt(squares / K + eps)


@triton.jit
def _normed_x(x_base, batch_ok, cols, col_ok, gamma, inv_rms, K, eps, NORM: tl.constexpr, BLOCK_K: tl.constexpr,
              DTYPE: tl.constexpr):
    """One [BLOCK_B, BLOCK_K] tile of x in float32, RMS-normalized (with NORM) as Qwen3RMSNorm rounds: normalized
    x to x's dtype, then times the weight `gamma`, rounded again. When one tile spans K (K <= BLOCK_K) the
    statistics come from this tile (masked columns are 0); otherwise `inv_rms` is the whole row's."""
    x = tl.load(x_base + cols[None, :], mask=batch_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    if NORM:
        if K <= BLOCK_K:
            inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / K + eps)
        x = round_to_dtype(round_to_dtype(x * inv_rms[:, None], DTYPE) * gamma, DTYPE)
    return x


@triton.jit
def _weight_tile(w_ptr, absmax_ptr, absmax2_ptr, code_ptr, code2_ptr, offset, rows, row_ok, k0, cols, col_ok, K,
                 DENSE: tl.constexpr, NESTED: tl.constexpr, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, AS_STORED: tl.constexpr):
    """W[rows, k0:k0 + BLOCK_K] as a [BLOCK_N, BLOCK_K] tile: float32, or a dense tile as stored (AS_STORED: a
    tensor-core dot takes the half-precision tile as it is).

    An NF4 tile is read as [BLOCK_N, BLOCK_K / 64, 32] bytes: one absmax per 64-element block (K is a multiple
    of 64, so blocks never straddle rows), each byte's high and low nibbles interleaved back into columns, the
    weights rounded to x's dtype as bitsandbytes' dequantize rounds them (the weights its matmul uses).
    """
    if DENSE:
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0)
        if not AS_STORED:
            w = w.to(tl.float32)
    else:
        groups = tl.arange(0, BLOCK_K // 64)  # 64: QUANT_BLOCK (a plain global cannot enter a Triton function)
        in_group = tl.arange(0, 32)
        blocks_per_row = K // 64
        block = k0 // 64 + groups
        scale_index = rows[:, None].to(tl.int64) * blocks_per_row + block[None, :]  # [BLOCK_N, GROUPS]
        scale_ok = row_ok[:, None] & (block < blocks_per_row)[None, :]
        if NESTED:
            quantized = tl.load(absmax_ptr + scale_index, mask=scale_ok, other=0).to(tl.int32)
            scale = tl.load(code2_ptr + quantized) * tl.load(absmax2_ptr + scale_index // 256,
                                                             mask=scale_ok, other=0.0) + offset
        else:
            scale = tl.load(absmax_ptr + scale_index, mask=scale_ok, other=0.0)
        packed = tl.load(w_ptr + scale_index[:, :, None] * 32 + in_group[None, None, :],
                         mask=scale_ok[:, :, None], other=0).to(tl.int32)
        high = round_to_dtype(tl.load(code_ptr + (packed >> 4)) * scale[:, :, None], DTYPE)
        low = round_to_dtype(tl.load(code_ptr + (packed & 15)) * scale[:, :, None], DTYPE)
        w = tl.reshape(tl.interleave(high, low), (BLOCK_N, BLOCK_K))
    return w


@triton.jit
def _tile(x_base, batch_ok, inv_rms, norm_ptr, w_ptr, absmax_ptr, absmax2_ptr, code_ptr, code2_ptr, offset,
          a_ptr, b_ptr, w1_ptr, absmax1_ptr, absmax2_1_ptr, offset1, a1_ptr, b1_ptr, r, batch, stride_xa, sync_ptr,
          workers, rows, N, K, k_lo, k_hi, eps, residual_ptr, stride_rb, residual_col,
          DENSE: tl.constexpr, NESTED: tl.constexpr, NORM: tl.constexpr, LORA: tl.constexpr,
          DTYPE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          BLOCK_R: tl.constexpr, CHUNKS: tl.constexpr, PRODUCT: tl.constexpr, PDL: tl.constexpr, SWAP: tl.constexpr,
          WAIT_IN_LOOP: tl.constexpr, PAIR: tl.constexpr, RESIDUAL: tl.constexpr):
    """norm(x) @ W[rows].T + (norm(x) @ A.T) @ B[rows].T for BLOCK_B rows of x, float32 [BLOCK_B, BLOCK_N], and
    with PAIR the same for a second weight's rows (w1...: gate and up), each tile of both read before either is
    multiplied; else zeros in its place. RESIDUAL: residual[:, residual_col + rows] added last (read before the
    LoRA's wait). LORA 1: norm(x) @ A.T along K beside the product, in every program; 2: read from `_lora_down`'s
    output; 3: read from what this launch's first programs publish, once `sync_ptr` counts `workers` of them.
    SWAP: the weight tile is the dot's left operand (`_tile_swapped`). `inv_rms`: as `_normed_x` takes it."""
    if SWAP:
        acc, acc1 = _tile_swapped(x_base, batch_ok, inv_rms, norm_ptr, w_ptr, absmax_ptr, absmax2_ptr, code_ptr,
                                  code2_ptr, offset, a_ptr, b_ptr, w1_ptr, absmax1_ptr, absmax2_1_ptr, offset1, a1_ptr,
                                  b1_ptr, r, batch, stride_xa, sync_ptr, workers, rows, N, K, k_lo, k_hi, eps,
                                  residual_ptr,
                                  stride_rb, residual_col, DENSE, NESTED, NORM, LORA, DTYPE, BLOCK_B, BLOCK_N,
                                  BLOCK_K, BLOCK_R, CHUNKS, PRODUCT, PDL and WAIT_IN_LOOP, PAIR, RESIDUAL)
    else:
        acc, acc1 = _tile_rows(x_base, batch_ok, inv_rms, norm_ptr, w_ptr, absmax_ptr, absmax2_ptr, code_ptr,
                               code2_ptr, offset, a_ptr, b_ptr, w1_ptr, absmax1_ptr, absmax2_1_ptr, offset1, a1_ptr,
                               b1_ptr, r, batch, stride_xa, sync_ptr, workers, rows, N, K, k_lo, k_hi, eps,
                               residual_ptr,
                               stride_rb, residual_col, DENSE, NESTED, NORM, LORA, DTYPE, BLOCK_B, BLOCK_N, BLOCK_K,
                               BLOCK_R, CHUNKS, PRODUCT, PDL, PAIR, RESIDUAL)
    return acc, acc1


@triton.jit
def _b_tiles(b_ptr, b1_ptr, rows, row_ok, ranks, r, TWO: tl.constexpr):
    """B[rows] [BLOCK_N, BLOCK_R] in float32 (B is [N, r], scaled by alpha / r), and with TWO the second weight's
    (else the first again)."""
    b_tile = tl.load(b_ptr + rows[:, None] * r + ranks[None, :], mask=row_ok[:, None] & (ranks[None, :] < r),
                     other=0.0).to(tl.float32)
    b1_tile = b_tile
    if TWO:
        b1_tile = tl.load(b1_ptr + rows[:, None] * r + ranks[None, :], mask=row_ok[:, None] & (ranks[None, :] < r),
                          other=0.0).to(tl.float32)
    return b_tile, b1_tile


@triton.jit
def _a_tiles(a_ptr, a1_ptr, ranks, r, cols, col_ok, K, TWO: tl.constexpr):
    """A[:, cols] [BLOCK_R, BLOCK_K] as stored (A is [r, K]), and with TWO the second weight's (else the first
    again)."""
    a = tl.load(a_ptr + ranks[:, None] * K + cols[None, :], mask=(ranks[:, None] < r) & col_ok[None, :], other=0.0)
    a1 = a
    if TWO:
        a1 = tl.load(a1_ptr + ranks[:, None] * K + cols[None, :], mask=(ranks[:, None] < r) & col_ok[None, :],
                     other=0.0)
    return a, a1


@triton.jit
def _tile_rows(x_base, batch_ok, inv_rms, norm_ptr, w_ptr, absmax_ptr, absmax2_ptr, code_ptr, code2_ptr, offset,
               a_ptr, b_ptr, w1_ptr, absmax1_ptr, absmax2_1_ptr, offset1, a1_ptr, b1_ptr, r, batch, stride_xa,
               sync_ptr, workers, rows, N, K, k_lo, k_hi, eps, residual_ptr, stride_rb, residual_col,
               DENSE: tl.constexpr, NESTED: tl.constexpr, NORM: tl.constexpr, LORA: tl.constexpr,
               DTYPE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_R: tl.constexpr, CHUNKS: tl.constexpr, PRODUCT: tl.constexpr, PDL: tl.constexpr,
               PAIR: tl.constexpr, RESIDUAL: tl.constexpr):
    """`_tile` with x as the left operand: x [BLOCK_B, BLOCK_K] times the weight tile transposed.

    B's tiles are read first and each step loads its weight tiles before x, so under PDL (broadcast products)
    they and the first weight tiles are read before the wait; dot loops wait before the loop (`_project`),
    since Triton pipelines their loads ahead.
    """
    ks = tl.arange(0, BLOCK_K)
    ranks = tl.arange(0, BLOCK_R)
    row_ok = rows < N
    acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
    xa = tl.zeros((BLOCK_B, BLOCK_R), dtype=tl.float32)
    xa1 = tl.zeros((BLOCK_B, BLOCK_R), dtype=tl.float32)
    if LORA > 0:
        b_tile, b1_tile = _b_tiles(b_ptr, b1_ptr, rows, row_ok, ranks, r, PAIR)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        cols = k0 + ks
        col_ok = cols < K
        w = _weight_tile(w_ptr, absmax_ptr, absmax2_ptr, code_ptr, code2_ptr, offset, rows, row_ok, k0, cols,
                         col_ok, K, DENSE, NESTED, DTYPE, BLOCK_N, BLOCK_K, PRODUCT == 1)
        if PAIR:
            w1 = _weight_tile(w1_ptr, absmax1_ptr, absmax2_1_ptr, code_ptr, code2_ptr, offset1, rows, row_ok, k0,
                              cols, col_ok, K, DENSE, NESTED, DTYPE, BLOCK_N, BLOCK_K, PRODUCT == 1)
        if LORA == 1:
            a, a1 = _a_tiles(a_ptr, a1_ptr, ranks, r, cols, col_ok, K, PAIR)
            if PRODUCT != 1:
                a, a1 = a.to(tl.float32), a1.to(tl.float32)
        gamma = 1.0
        if NORM:
            gamma = tl.load(norm_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if PDL and PRODUCT >= 2:  # what earlier kernels wrote is read from here on (a no-op after the first step)
            gdc_wait()
        x = _normed_x(x_base, batch_ok, cols, col_ok, gamma, inv_rms, K, eps, NORM, BLOCK_K, DTYPE)
        acc += _product(x, w, PRODUCT, DTYPE)
        if PAIR:
            acc1 += _product(x, w1, PRODUCT, DTYPE)
        if LORA == 1:
            xa += _product(x, a, PRODUCT, DTYPE)
            if PAIR:
                xa1 += _product(x, a1, PRODUCT, DTYPE)
    if RESIDUAL:
        residual = tl.load(residual_ptr + batch[:, None].to(tl.int64) * stride_rb + residual_col + rows[None, :],
                           mask=batch_ok[:, None] & row_ok[None, :], other=0.0).to(tl.float32)
    if LORA >= 2:  # x @ A.T of this launch, computed once: a_ptr is this weight's first column of it
        if LORA == 3:  # by this launch's first programs, published through sync_ptr
            _wait_for_workers(sync_ptr, workers)
        xa = _published_xa(a_ptr, stride_xa, batch, ranks, r, batch_ok[:, None], CHUNKS)
        if PAIR:
            xa1 = _published_xa(a1_ptr, stride_xa, batch, ranks, r, batch_ok[:, None], CHUNKS)
    if LORA > 0:
        acc += _product(xa, b_tile, 0 if PRODUCT == 1 else PRODUCT, DTYPE)
        if PAIR:
            acc1 += _product(xa1, b1_tile, 0 if PRODUCT == 1 else PRODUCT, DTYPE)
    if RESIDUAL:
        acc += residual
    return acc, acc1


@triton.jit
def _tile_swapped(x_base, batch_ok, inv_rms, norm_ptr, w_ptr, absmax_ptr, absmax2_ptr, code_ptr, code2_ptr, offset,
                  a_ptr, b_ptr, w1_ptr, absmax1_ptr, absmax2_1_ptr, offset1, a1_ptr, b1_ptr, r, batch, stride_xa,
                  sync_ptr, workers, rows, N, K, k_lo, k_hi, eps, residual_ptr, stride_rb, residual_col,
                  DENSE: tl.constexpr, NESTED: tl.constexpr, NORM: tl.constexpr, LORA: tl.constexpr,
                  DTYPE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_R: tl.constexpr, CHUNKS: tl.constexpr, PRODUCT: tl.constexpr, WAIT_HERE: tl.constexpr,
                  PAIR: tl.constexpr, RESIDUAL: tl.constexpr):
    """`_tile` with the weight tile as the left operand: W[rows] [BLOCK_N, BLOCK_K] times x transposed
    [BLOCK_K, BLOCK_B], accumulated as [BLOCK_N, BLOCK_B] and transposed once at the end.

    A few rows of x against many of W: the dot's M (64 rows on Hopper's warpgroup MMA) is the weights', not
    x's padded to 16, so one program takes a wide weight tile and x rides along as the narrow operand. With
    LORA 1, A's r rows are a second small dot against the same x tile, read from L2 by every program (A is
    r / BLOCK_N of the weight tile's bytes) instead of a `_lora_down` launch. PRODUCT 1: half-precision
    operands, float32 accumulator; 0: float32 dots (Triton's interpreter, float32 models). WAIT_HERE (PDL
    without software pipelining): wait for the kernel before after the first weight tile is loaded, so that
    its read overlaps the predecessor's tail, as the broadcast tiles do. PAIR: both weights' tiles in one loop.
    """
    ks = tl.arange(0, BLOCK_K)
    ranks = tl.arange(0, BLOCK_R)
    row_ok = rows < N
    acc = tl.zeros((BLOCK_N, BLOCK_B), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_B), dtype=tl.float32)
    xa = tl.zeros((BLOCK_R, BLOCK_B), dtype=tl.float32)
    xa1 = tl.zeros((BLOCK_R, BLOCK_B), dtype=tl.float32)
    if LORA > 0:
        b_tile, b1_tile = _b_tiles(b_ptr, b1_ptr, rows, row_ok, ranks, r, PAIR)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        cols = k0 + ks
        col_ok = cols < K
        w = _weight_tile(w_ptr, absmax_ptr, absmax2_ptr, code_ptr, code2_ptr, offset, rows, row_ok, k0, cols,
                         col_ok, K, DENSE, NESTED, DTYPE, BLOCK_N, BLOCK_K, PRODUCT == 1)
        if PAIR:
            w1 = _weight_tile(w1_ptr, absmax1_ptr, absmax2_1_ptr, code_ptr, code2_ptr, offset1, rows, row_ok, k0,
                              cols, col_ok, K, DENSE, NESTED, DTYPE, BLOCK_N, BLOCK_K, PRODUCT == 1)
        gamma = 1.0
        if NORM:
            gamma = tl.load(norm_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if WAIT_HERE:
            gdc_wait()
        x = tl.trans(_normed_x(x_base, batch_ok, cols, col_ok, gamma, inv_rms, K, eps, NORM, BLOCK_K, DTYPE))
        if LORA == 1:
            a, a1 = _a_tiles(a_ptr, a1_ptr, ranks, r, cols, col_ok, K, PAIR)
        if PRODUCT == 1:
            half = tl.bfloat16 if DTYPE == 0 or DTYPE == 3 else tl.float16
            acc = tl.dot(w.to(half), x.to(half), acc)
            if PAIR:
                acc1 = tl.dot(w1.to(half), x.to(half), acc1)
            if LORA == 1:
                xa = tl.dot(a.to(half), x.to(half), xa)
                if PAIR:
                    xa1 = tl.dot(a1.to(half), x.to(half), xa1)
        else:
            acc = tl.dot(w.to(tl.float32), x, acc, input_precision="ieee")
            if PAIR:
                acc1 = tl.dot(w1.to(tl.float32), x, acc1, input_precision="ieee")
            if LORA == 1:
                xa = tl.dot(a.to(tl.float32), x, xa, input_precision="ieee")
                if PAIR:
                    xa1 = tl.dot(a1.to(tl.float32), x, xa1, input_precision="ieee")
    if RESIDUAL:
        residual = tl.load(residual_ptr + batch[None, :].to(tl.int64) * stride_rb + residual_col + rows[:, None],
                           mask=batch_ok[None, :] & row_ok[:, None], other=0.0).to(tl.float32)
    if LORA >= 2:
        if LORA == 3:
            _wait_for_workers(sync_ptr, workers)
        xa = tl.trans(_published_xa(a_ptr, stride_xa, batch, ranks, r, batch_ok[:, None], CHUNKS))
        if PAIR:
            xa1 = tl.trans(_published_xa(a1_ptr, stride_xa, batch, ranks, r, batch_ok[:, None], CHUNKS))
    if LORA > 0:
        acc = tl.dot(b_tile, xa, acc, input_precision="ieee")
        if PAIR:
            acc1 = tl.dot(b1_tile, xa1, acc1, input_precision="ieee")
    if RESIDUAL:
        acc += residual
    return tl.trans(acc), tl.trans(acc1)


@triton.jit
def _lora_down_rows(x_ptr, stride_xb, B, K, norm_ptr, eps, a_ptr, R, xa_ptr, rank_block, batch_block, chunk,
                    NORM: tl.constexpr, DTYPE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_K: tl.constexpr, PDL: tl.constexpr, CHUNKS: tl.constexpr):
    """xa[batch_block, chunk, rank_block] of norm(x) @ A.T in float32 for a launch's stacked A [R, K]: BLOCK_B
    rows of x against BLOCK_R ranks over the chunk's K / CHUNKS columns (whole BLOCK_K tiles; its partial, which
    `_published_xa` sums with the other chunks'), each A tile loaded before PDL's wait. With more than one chunk
    a program reads one tile, so no load waits on an earlier one after the wait."""
    ranks = rank_block * BLOCK_R + tl.arange(0, BLOCK_R)
    batch = batch_block * BLOCK_B + tl.arange(0, BLOCK_B)
    batch_ok, rank_ok = batch < B, ranks < R
    x_base = x_ptr + batch[:, None].to(tl.int64) * stride_xb
    inv_rms = tl.zeros((BLOCK_B,), dtype=tl.float32)
    if NORM and K > BLOCK_K:
        if PDL:
            gdc_wait()
        inv_rms = _inverse_rms(x_base, batch_ok, K, eps, BLOCK_B, BLOCK_K)
    xa = tl.zeros((BLOCK_B, BLOCK_R), dtype=tl.float32)
    k_lo, k_hi = 0, K
    if CHUNKS > 1:
        span = tl.cdiv(tl.cdiv(K, BLOCK_K), CHUNKS) * BLOCK_K
        k_lo, k_hi = chunk * span, tl.minimum(K, (chunk + 1) * span)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        a = tl.load(a_ptr + ranks[:, None] * K + cols[None, :], mask=rank_ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        gamma = 1.0
        if NORM:
            gamma = tl.load(norm_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if PDL:
            gdc_wait()
        x = _normed_x(x_base, batch_ok, cols, col_ok, gamma, inv_rms, K, eps, NORM, BLOCK_K, DTYPE)
        xa += _product(x, a, 2, DTYPE)
    tl.store(xa_ptr + batch[:, None].to(tl.int64) * (CHUNKS * R) + chunk * R + ranks[None, :], xa,
             mask=batch_ok[:, None] & rank_ok[None, :])


@triton.jit
def _lora_down(x_ptr, stride_xb, B, K, norm_ptr, eps, a_ptr, R, xa_ptr, NORM: tl.constexpr, DTYPE: tl.constexpr,
               BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
               CHUNKS: tl.constexpr):
    """xa [B, R] = norm(x) @ A.T as a launch of its own (`project` without `lora_sync`), before the projection."""
    if PDL:
        gdc_launch_dependents()
    _lora_down_rows(x_ptr, stride_xb, B, K, norm_ptr, eps, a_ptr, R, xa_ptr, tl.program_id(0), tl.program_id(1),
                    tl.program_id(2), NORM, DTYPE, BLOCK_B, BLOCK_R, BLOCK_K, PDL, CHUNKS)


@triton.jit
def _published_xa(a_ptr, stride_xa, batch, ranks, r, ok, CHUNKS: tl.constexpr):
    """x @ A.T [BLOCK_B, BLOCK_R] of this weight's ranks (its columns from a_ptr) from what `_lora_down_rows`
    wrote: xa [B, CHUNKS, stride_xa], one partial a chunk of K, summed in order (the same sums, in the same
    order, as one program's loop over the chunks). `ok`: which rows to read ([BLOCK_B, 1] or [BLOCK_B, BLOCK_R])."""
    at = a_ptr + batch[:, None].to(tl.int64) * (CHUNKS * stride_xa) + ranks[None, :]
    mask = ok & (ranks[None, :] < r)
    xa = tl.load(at, mask=mask, other=0.0, cache_modifier=".cg")
    for chunk in tl.static_range(1, CHUNKS):  # one load each, all issued together
        xa += tl.load(at + chunk * stride_xa, mask=mask, other=0.0, cache_modifier=".cg")
    return xa


@triton.jit
def _wait_for_workers(sync_ptr, workers):
    """Spin until `workers` programs have published xa (`_project`'s first programs), then read it: one thread
    acquires the count, the barrier orders the whole program's later loads after it."""
    done = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    while done < workers:
        done = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _store(acc, y_ptr, stride_yb, batch, batch_ok, columns, column_ok, residual_ptr, stride_rb,
           RESIDUAL: tl.constexpr):
    ok = batch_ok[:, None] & column_ok[None, :]
    if RESIDUAL:
        acc += tl.load(residual_ptr + batch[:, None].to(tl.int64) * stride_rb + columns[None, :], mask=ok,
                       other=0.0).to(tl.float32)
    tl.store(y_ptr + batch[:, None].to(tl.int64) * stride_yb + columns[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=ok)


@triton.jit
def _split_finish(acc, acc1, ws_ptr, count_ptr, slot_index, kslice, rows, row_ok, batch, batch_ok, a_ptr, b_ptr,
                  a1_ptr, b1_ptr, r, stride_xa, sync_ptr, workers, residual_ptr, stride_rb, residual_col,
                  SPLIT_K: tl.constexpr, LORA: tl.constexpr, TWO: tl.constexpr, RESIDUAL: tl.constexpr,
                  BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, CHUNKS: tl.constexpr):
    """Split K: this program's partial product(s) [BLOCK_B, BLOCK_N] (TWO: gate's and up's) into the workspace,
    then the program that arrives last at the tile's counter sums the SPLIT_K partials in order and adds the
    LoRA (LORA 2 or 3: x @ A.T computed once; B's tiles and the residual read before the counter) and the
    residual; it zeroes the counter for the next launch. Returns ([BLOCK_N] whether this program holds the sums,
    the sums, the second sums)."""
    ranks = tl.arange(0, BLOCK_R)
    cells = tl.arange(0, BLOCK_B)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    size: tl.constexpr = BLOCK_B * BLOCK_N
    base = ws_ptr + slot_index.to(tl.int64) * (SPLIT_K * 2 * size)
    if LORA > 0:
        b_tile, b1_tile = _b_tiles(b_ptr, b1_ptr, rows, row_ok, ranks, r, TWO)
    if RESIDUAL:
        residual = tl.load(residual_ptr + batch[:, None].to(tl.int64) * stride_rb + residual_col + rows[None, :],
                           mask=batch_ok[:, None] & row_ok[None, :], other=0.0).to(tl.float32)
    tl.store(base + kslice * 2 * size + cells, acc)
    if TWO:
        tl.store(base + (kslice * 2 + 1) * size + cells, acc1)
    tl.debug_barrier()  # the whole program's partials before the release
    arrived = tl.atomic_add(count_ptr + slot_index, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()  # and the last program's reads of them after its acquire
    last = (cells * 0 + arrived) == SPLIT_K - 1
    total = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
    total1 = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(base + s * 2 * size + cells, mask=last, other=0.0, cache_modifier=".cg")
        if TWO:
            total1 += tl.load(base + (s * 2 + 1) * size + cells, mask=last, other=0.0, cache_modifier=".cg")
    if LORA > 0:
        if LORA == 3:
            if arrived == SPLIT_K - 1:
                _wait_for_workers(sync_ptr, workers)
        xa_ok = batch_ok[:, None] & ((ranks[None, :] * 0 + arrived) == SPLIT_K - 1)
        xa = _published_xa(a_ptr, stride_xa, batch, ranks, r, xa_ok, CHUNKS)
        total += _product(xa, b_tile, 2, 0)
        if TWO:
            xa1 = _published_xa(a1_ptr, stride_xa, batch, ranks, r, xa_ok, CHUNKS)
            total1 += _product(xa1, b1_tile, 2, 0)
    if RESIDUAL:
        total += residual
    if arrived == SPLIT_K - 1:
        tl.atomic_xchg(count_ptr + slot_index, 0, sem="relaxed", scope="gpu")
    return (rows * 0 + arrived) == SPLIT_K - 1, total, total1


@triton.jit
def _part(x_base, batch_ok, inv_rms, norm_ptr, w_ptr, absmax_ptr, absmax2_ptr, code_ptr, code2_ptr, offset, a_ptr,
          b_ptr, r, batch, stride_xa, sync_ptr, workers, rows, N, col0, K, k_lo, k_hi, eps, y_ptr, stride_yb,
          residual_ptr, stride_rb, ws_ptr, count_ptr, slot_index, kslice,
          DENSE: tl.constexpr, NESTED: tl.constexpr, NORM: tl.constexpr, TILE_LORA: tl.constexpr,
          FINISH_LORA: tl.constexpr, DTYPE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, CHUNKS: tl.constexpr, PRODUCT: tl.constexpr,
          PDL: tl.constexpr, SWAP: tl.constexpr, WAIT_IN_LOOP: tl.constexpr, RESIDUAL: tl.constexpr,
          SPLIT_K: tl.constexpr):
    """One weight's rows of a side-by-side launch into y[:, col0 + rows] (+ residual): the tile, and with SPLIT_K
    its partial over K until the last program of the tile sums them (the residual applied there). TILE_LORA,
    FINISH_LORA: the LoRA in the tile and in the split's last program (`_project`)."""
    TILE_RESIDUAL: tl.constexpr = RESIDUAL and SPLIT_K == 1
    acc, _ = _tile(x_base, batch_ok, inv_rms, norm_ptr, w_ptr, absmax_ptr, absmax2_ptr, code_ptr, code2_ptr, offset,
                   a_ptr, b_ptr, w_ptr, absmax_ptr, absmax2_ptr, offset, a_ptr, b_ptr, r, batch, stride_xa, sync_ptr,
                   workers, rows, N, K, k_lo, k_hi, eps, residual_ptr, stride_rb, col0, DENSE, NESTED, NORM,
                   TILE_LORA, DTYPE, BLOCK_B, BLOCK_N, BLOCK_K, BLOCK_R, CHUNKS, PRODUCT, PDL, SWAP, WAIT_IN_LOOP,
                   False, TILE_RESIDUAL)
    row_ok = rows < N
    if SPLIT_K > 1:  # only the program that holds the sums stores
        done, acc, _ = _split_finish(acc, acc, ws_ptr, count_ptr, slot_index, kslice, rows, row_ok, batch,
                                     batch_ok, a_ptr, b_ptr, a_ptr, b_ptr, r, stride_xa, sync_ptr, workers,
                                     residual_ptr, stride_rb, col0, SPLIT_K, FINISH_LORA, False, RESIDUAL, BLOCK_B,
                                     BLOCK_N, BLOCK_R, CHUNKS)
        row_ok = row_ok & done
    _store(acc, y_ptr, stride_yb, batch, batch_ok, col0 + rows, row_ok, residual_ptr, stride_rb, False)


@triton.jit
def _project(x_ptr, stride_xb, B, K, norm_ptr, eps, code_ptr, code2_ptr, r,
             w0, absmax0, absmax2_0, offset0, a0, b0, n0,
             w1, absmax1, absmax2_1, offset1, a1, b1, n1,
             w2, absmax2, absmax2_2, offset2, a2, b2, n2,
             y_ptr, stride_yb, residual_ptr, stride_rb, stride_xa, a_stacked_ptr, xa_ptr, sync_ptr, workers,
             ws_ptr, count_ptr, k_split,
             PARTS: tl.constexpr, SILU_MUL: tl.constexpr, DENSE: tl.constexpr, NESTED: tl.constexpr,
             NORM: tl.constexpr, LORA: tl.constexpr, RESIDUAL: tl.constexpr, DTYPE: tl.constexpr,
             BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
             PRODUCT: tl.constexpr, PDL: tl.constexpr, SWAP: tl.constexpr, WAIT_IN_LOOP: tl.constexpr,
             DOWN_B: tl.constexpr, DOWN_R: tl.constexpr, DOWN_K: tl.constexpr, PAIR: tl.constexpr,
             SPLIT_K: tl.constexpr, CHUNKS: tl.constexpr):
    """One launch's programs over 1-3 weights (`project`). With LORA 3 the first `workers` programs compute
    norm(x) @ A.T for the whole launch (`_lora_down`'s work, as `_lora_down` splits it) and publish it through
    sync_ptr [2] (published count, finished programs); the others read it after their weight tiles. The last
    program to finish zeroes sync_ptr for the next launch (a CUDA graph replays the same counters). SPLIT_K:
    each tile's K split over that many programs (`_split_finish`, counters `count_ptr`, partials `ws_ptr`);
    PAIR: gate's and up's tiles in one loop rather than one after the other. CHUNKS: x @ A.T's K in that many
    chunks, one worker each (its partial), summed by the programs that read it (`_published_xa`)."""
    if PDL:
        gdc_launch_dependents()
        if PRODUCT < 2 and not WAIT_IN_LOOP:  # pipelined dot loops would move their first loads of x above a
            gdc_wait()  # wait inside the loop
    block = tl.program_id(0)
    if LORA == 3 and block < workers:
        rank_blocks, batch_blocks = tl.cdiv(stride_xa, DOWN_R), tl.cdiv(B, DOWN_B)
        _lora_down_rows(x_ptr, stride_xb, B, K, norm_ptr, eps, a_stacked_ptr, stride_xa, xa_ptr, block % rank_blocks,
                        block // rank_blocks % batch_blocks, block // (rank_blocks * batch_blocks), NORM, DTYPE,
                        DOWN_B, DOWN_R, DOWN_K, PDL, CHUNKS)
        tl.debug_barrier()  # the whole program's stores before the release
        tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    else:
        if LORA == 3:
            block -= workers
        batch = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        batch_ok = batch < B
        x_base = x_ptr + batch[:, None].to(tl.int64) * stride_xb
        inv_rms = tl.zeros((BLOCK_B,), dtype=tl.float32)
        if NORM:
            if K > BLOCK_K:  # statistics over the whole row first (one tile: `_tile` takes them from it)
                if PDL:
                    gdc_wait()
                inv_rms = _inverse_rms(x_base, batch_ok, K, eps, BLOCK_B, BLOCK_K)
        local = tl.arange(0, BLOCK_N)
        kslice = 0
        if SPLIT_K > 1:  # SPLIT_K programs a tile, each over k_split columns of K
            kslice = block % SPLIT_K
            block = block // SPLIT_K
        k_lo = kslice * k_split
        k_hi = tl.minimum(K, k_lo + k_split)
        slot_index = tl.program_id(1) * ((tl.num_programs(0) - workers) // SPLIT_K) + block
        # with a split the last program adds x @ A.T's product with B, unless every program computes its K's share
        # of x @ A.T (LORA 1): then each applies B to that share, and the partials carry it (the product is linear)
        TILE_LORA: tl.constexpr = LORA if SPLIT_K == 1 or LORA == 1 else 0
        FINISH_LORA: tl.constexpr = 0 if LORA == 1 else LORA
        if SILU_MUL:  # gate (part 0) and up (part 1), the same rows: SiLU(gate) * up, each rounded as the modules round
            rows = block * BLOCK_N + local
            if PAIR:
                gate, up = _tile(x_base, batch_ok, inv_rms, norm_ptr, w0, absmax0, absmax2_0, code_ptr, code2_ptr,
                                 offset0, a0, b0, w1, absmax1, absmax2_1, offset1, a1, b1, r, batch, stride_xa,
                                 sync_ptr, workers, rows, n0, K, k_lo, k_hi, eps, residual_ptr, stride_rb, 0, DENSE,
                                 NESTED, NORM, TILE_LORA, DTYPE, BLOCK_B, BLOCK_N, BLOCK_K, BLOCK_R, CHUNKS, PRODUCT,
                                 PDL, SWAP, WAIT_IN_LOOP, True, False)
            else:
                gate, _ = _tile(x_base, batch_ok, inv_rms, norm_ptr, w0, absmax0, absmax2_0, code_ptr, code2_ptr,
                                offset0, a0, b0, w0, absmax0, absmax2_0, offset0, a0, b0, r, batch, stride_xa,
                                sync_ptr, workers, rows, n0, K, k_lo, k_hi, eps, residual_ptr, stride_rb, 0, DENSE,
                                NESTED, NORM, TILE_LORA, DTYPE, BLOCK_B, BLOCK_N, BLOCK_K, BLOCK_R, CHUNKS, PRODUCT,
                                PDL, SWAP, WAIT_IN_LOOP, False, False)
                up, _ = _tile(x_base, batch_ok, inv_rms, norm_ptr, w1, absmax1, absmax2_1, code_ptr, code2_ptr,
                              offset1, a1, b1, w1, absmax1, absmax2_1, offset1, a1, b1, r, batch, stride_xa,
                              sync_ptr, workers, rows, n1, K, k_lo, k_hi, eps, residual_ptr, stride_rb, 0, DENSE,
                              NESTED, NORM, TILE_LORA, DTYPE, BLOCK_B, BLOCK_N, BLOCK_K, BLOCK_R, CHUNKS, PRODUCT,
                              PDL, SWAP, WAIT_IN_LOOP, False, False)
            done = rows >= 0
            if SPLIT_K > 1:
                done, gate, up = _split_finish(gate, up, ws_ptr, count_ptr, slot_index, kslice, rows, rows < n0,
                                               batch, batch_ok, a0, b0, a1, b1, r, stride_xa, sync_ptr, workers,
                                               residual_ptr, stride_rb, 0, SPLIT_K, FINISH_LORA, True, False,
                                               BLOCK_B, BLOCK_N, BLOCK_R, CHUNKS)
            gate, up = round_to_dtype(gate, DTYPE), round_to_dtype(up, DTYPE)
            acc = round_to_dtype(gate / (1.0 + tl.exp(-gate)), DTYPE) * up
            _store(acc, y_ptr, stride_yb, batch, batch_ok, rows, (rows < n0) & done, residual_ptr, stride_rb,
                   RESIDUAL)
        else:  # the parts side by side: this program's rows lie in one of them (the residual read in `_tile`)
            blocks0 = tl.cdiv(n0, BLOCK_N)
            blocks1 = tl.cdiv(n1, BLOCK_N)
            if block < blocks0:
                _part(x_base, batch_ok, inv_rms, norm_ptr, w0, absmax0, absmax2_0, code_ptr, code2_ptr, offset0, a0,
                      b0, r, batch, stride_xa, sync_ptr, workers, block * BLOCK_N + local, n0, 0, K, k_lo, k_hi, eps,
                      y_ptr, stride_yb, residual_ptr, stride_rb, ws_ptr, count_ptr, slot_index, kslice, DENSE,
                      NESTED, NORM, TILE_LORA, FINISH_LORA, DTYPE, BLOCK_B, BLOCK_N, BLOCK_K, BLOCK_R, CHUNKS,
                      PRODUCT, PDL, SWAP, WAIT_IN_LOOP, RESIDUAL, SPLIT_K)
            else:
                if PARTS > 1:
                    if block < blocks0 + blocks1:
                        _part(x_base, batch_ok, inv_rms, norm_ptr, w1, absmax1, absmax2_1, code_ptr, code2_ptr,
                              offset1, a1, b1, r, batch, stride_xa, sync_ptr, workers,
                              (block - blocks0) * BLOCK_N + local, n1, n0, K, k_lo, k_hi, eps, y_ptr, stride_yb,
                              residual_ptr, stride_rb, ws_ptr, count_ptr, slot_index, kslice, DENSE, NESTED, NORM,
                              TILE_LORA, FINISH_LORA, DTYPE, BLOCK_B, BLOCK_N, BLOCK_K, BLOCK_R, CHUNKS, PRODUCT,
                              PDL, SWAP, WAIT_IN_LOOP, RESIDUAL, SPLIT_K)
                    else:
                        if PARTS > 2:
                            _part(x_base, batch_ok, inv_rms, norm_ptr, w2, absmax2, absmax2_2, code_ptr, code2_ptr,
                                  offset2, a2, b2, r, batch, stride_xa, sync_ptr, workers,
                                  (block - blocks0 - blocks1) * BLOCK_N + local, n2, n0 + n1, K, k_lo, k_hi, eps,
                                  y_ptr, stride_yb, residual_ptr, stride_rb, ws_ptr, count_ptr, slot_index, kslice,
                                  DENSE, NESTED, NORM, TILE_LORA, FINISH_LORA, DTYPE, BLOCK_B, BLOCK_N, BLOCK_K,
                                  BLOCK_R, CHUNKS, PRODUCT, PDL, SWAP, WAIT_IN_LOOP, RESIDUAL, SPLIT_K)
        if LORA == 3:  # every program before the last has passed its wait: the last one zeroes the counters
            finished = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
            if finished == tl.num_programs(0) - workers - 1:
                tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")


@dataclass(frozen=True)
class Weight:
    """One linear's weight as the kernels read it, with its LoRA adapter (A [r, K], B [N, r] scaled) or none."""

    n: int
    k: int
    data: torch.Tensor  # packed NF4 bytes (flat uint8) or the dense [N, K] matrix
    absmax: torch.Tensor | None = None
    absmax2: torch.Tensor | None = None
    code: torch.Tensor | None = None
    code2: torch.Tensor | None = None
    offset: float = 0.0  # a float, read once: reading the tensor syncs, and a CUDA graph capture refuses that
    nested: bool = False
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None

    @property
    def dense(self) -> bool:
        return self.absmax is None

    @classmethod
    def of(cls, base: torch.nn.Module, a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> "Weight":
        """A bias-free nn.Linear or bitsandbytes Linear4bit (NF4, 64-element blocks); ValueError for others."""
        if getattr(base, "bias", None) is not None:
            raise ValueError(f"{type(base).__name__} has a bias; the decode kernels read bias-free linears")
        lora = {} if a is None else {"lora_a": a.contiguous(), "lora_b": b.contiguous()}
        state = getattr(base.weight, "quant_state", None)
        if state is None:
            if type(base) is not torch.nn.Linear:
                raise ValueError(f"{type(base).__name__} is neither an nn.Linear nor an NF4 layer")
            n, k = base.weight.shape
            return cls(n, k, base.weight.contiguous(), **lora)
        return cls.nf4(base.weight, state, **lora)

    @classmethod
    def nf4(cls, packed: torch.Tensor, state, lora_a: torch.Tensor | None = None,
            lora_b: torch.Tensor | None = None) -> "Weight":
        n, k = state.shape
        if getattr(state, "packing_format_for_cpu", False):  # bitsandbytes' eval forward on an AVX512-BF16 CPU
            raise ValueError("this NF4 weight is in bitsandbytes' CPU-kernel layout (packing_format_for_cpu); the "
                             "decode kernels read its standard packed layout")
        if k % QUANT_BLOCK:
            raise ValueError(f"the NF4 kernels need in_features a multiple of {QUANT_BLOCK}; got {k}")
        if state.blocksize != QUANT_BLOCK or getattr(state, "quant_type", "nf4") != "nf4":
            raise ValueError(f"needs NF4 with block size {QUANT_BLOCK}; got {state.quant_type} / {state.blocksize}")
        if packed.dtype != torch.uint8 or packed.numel() * 2 != n * k:
            raise ValueError(f"packed must hold {n * k // 2} uint8 bytes; got {packed.numel()} {packed.dtype}")
        nested = bool(state.nested)
        if nested and state.state2.blocksize != NESTED_BLOCK:
            raise ValueError(f"needs nested absmax blocks of {NESTED_BLOCK}; got {state.state2.blocksize}")
        return cls(n, k, packed.view(-1), absmax=state.absmax,
                   absmax2=state.state2.absmax if nested else state.absmax,
                   code=state.code, code2=state.state2.code if nested else state.code,
                   offset=float(state.offset) if nested else 0.0, nested=nested, lora_a=lora_a, lora_b=lora_b)


@dataclass(frozen=True)
class Tiles:
    """How one `project` launch multiplies: `_product`'s kind, the tile, whether the weight tile is the dots'
    left operand (`_tile_swapped`), Triton's pipelining stages (None: its default), and whether norm(x) @ A.T
    is computed in every program beside its weight tile rather than once by `_lora_down`."""
    product: int
    block_n: int
    block_k: int
    swap: bool = False
    num_stages: int | None = None
    a_per_program: bool = False
    split_k: int = 1  # programs a tile along K (`project(split_k=...)`), where the caller gives counters
    pair: bool = True  # gate's and up's tiles in one loop


def tile_config(batch: int, on_gpu: bool, dense: bool = False, silu_mul: bool = False, lora: bool = True,
                parts: int = 1) -> Tiles:
    """The tiles for a launch over `batch` rows of x, from the whole replayed step on one H200
    (benchmarks/results/decode_step_sweep_h200.md).

    Broadcast sums (NF4 up to 8 rows, dense weights up to 4): weight tiles 1024 wide, 8 rows (many programs, each
    weight load issued before the wait on the previous launch), K split over up to 4 programs where it is wider
    (o_proj and down_proj: every program's weights read before the wait), gate's and up's tiles in one loop.
    NF4 gate and up at one row take 4-row tiles (the step 1.174 ms against 1.223 with 8-row ones in session 10;
    bf16 1.020 against 0.933), and so do all NF4 launches at 2-8 rows (session 13: 1.404 against 1.517 ms at 2,
    1.865 against 1.930 at 4, 3.047 against 3.083 at 8) and dense weights without an adapter at 2-4 rows
    (0.909 against 0.935 ms at 2 rows, 1.121 against 1.228 at 4; with LoRA 8 rows, 1.197 against 1.279 at 2).
    Dense weights at 2 and 4 rows took 1.197 and 1.600 ms so with LoRA against 2.079 and 1.877 in swapped tiles
    (session 13). From 4 rows, NF4's and those of dense weights with an adapter sum every row at once
    (`PRODUCT_BROADCAST_AT_ONCE`; session 15 on an H100: NF4 1.794 against 1.906 ms at 4 rows, 2.687 against 3.072
    at 8; bf16 1.627 against 1.701 at 4); at 2 rows it was no faster, and the dense copy (no adapter) at 4 rows
    slower (1.237 against 1.178).

    Swapped tensor-core tiles (dense weights from 5 rows): 32 x 256 over 3 stages with x @ A.T in every program,
    gate's loop then up's (2.36 ms against 3.45 for the unswapped tiles and 2.78 for the module step at 8 bf16
    rows in session 7; one loop for gate and up was slower in session 9). Without an adapter, up to 8 rows, tiles
    64 x 256 with K split over up to 3 programs (2 for K 1024): 1.24-1.28 ms at 5-8 rows against 1.39-1.45 for
    32 x 256 split 2 and 1.64 for no split (session 13); with LoRA a split was slower (2.166 against 1.954 at 8)
    and 64-row tiles do not fit shared memory beside A's. NF4 past 8 rows: tensor-core tiles.

    With an adapter at 5-8 rows each launch kind was timed on its own in the step (session 17, one H100, bf16 at
    8 slots, 1.925 ms with the tiles above for all): o_proj and down_proj (`parts` 1, no SiLU) take every row's
    broadcast sums at once as at 4 rows (1.833 and 1.727 ms), gate and up the swapped tiles with K over 2 programs
    (1.671); qkv kept its tiles (1.988-2.502 with the others). Together (session 18, one H100): 1.70-1.73 ms at
    5-8 bf16 slots against 1.87-2.23 on the swapped tiles for all; gate/up's K over 4 programs 1.81-1.85.
    """
    if not on_gpu:  # Triton's interpreter runs programs one by one in Python: the fewest, largest tiles
        return Tiles(PRODUCT_DOT32, 64, 1024)
    single = parts == 1 and not silu_mul  # o_proj, down_proj
    if dense and batch > 4 and not (lora and single and batch <= 8):
        if not lora and batch <= 8:
            return Tiles(PRODUCT_TENSOR_CORE, 64, 256, swap=True, num_stages=3, split_k=3, pair=False)
        split = 2 if silu_mul and batch <= 8 else 1
        return Tiles(PRODUCT_TENSOR_CORE, 32, 256, swap=True, num_stages=3, a_per_program=True, split_k=split,
                     pair=False)
    if batch <= 8:
        narrow = (not dense and (silu_mul or batch > 1)) or (dense and not lora and batch > 1)
        at_once = batch >= 4 and (not dense or lora)
        return Tiles(PRODUCT_BROADCAST_AT_ONCE if at_once else PRODUCT_BROADCAST, 4 if narrow else 8, 1024, split_k=4)
    return Tiles(PRODUCT_TENSOR_CORE, 32, 256)


def project(x: torch.Tensor, weights: list[Weight], *, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
            residual: torch.Tensor | None = None, silu_mul: bool = False, block_n: int | None = None,
            block_k: int | None = None, product: int | None = None, num_warps: int = 4,
            num_stages: int | None = None, lora_a_stacked: torch.Tensor | None = None,
            swap: bool | None = None, a_per_program: bool | None = None,
            lora_sync: torch.Tensor | None = None, span_k: bool = False, split_k: int | None = None,
            split_counters: torch.Tensor | None = None, pair: bool | None = None,
            max_registers: int | None = None) -> torch.Tensor:
    """norm(x) through 1-3 weights of one kind: side by side -> [B, sum N] (+ residual), or with `silu_mul`
    (two weights, gate then up) SiLU(gate) * up -> [B, N].

    `norm_weight`: an RMSNorm of x first (float32 statistics, as Qwen3's); `residual`: [B, N] added at the end;
    `product`, `block_n`, `block_k`: how the tiles multiply (`_product`) and their size; by default
    `swap`, `num_stages`: as `Tiles`; each left None takes `tile_config`'s choice for the batch.
    `lora_a_stacked`: the weights' A matrices stacked [len * r, K] (`stack_lora_a`), so that norm(x) @ A.T can
    be computed once for the launch (`_lora_down`, one more launch); `a_per_program` (None: the tiles' choice)
    computes it in every program beside its weight tile instead, as it is without `lora_a_stacked`.
    `lora_sync`: int32 [2] zeros on x's device, owned by this call site (a CUDA graph replays it), and left zeroed:
    with it `_lora_down`'s programs run as the first programs of the projection's own launch, one launch instead
    of two, where the launch covers x in one block of rows.
    `span_k` (broadcast products): one tile as wide as K (up to `SPAN_K_MAX`) with as many fewer weight rows,
    the same elements a tile, so that every program's weights are read in one step, before PDL's wait.
    `split_k` (None: the tiles' choice): each tile's K split over up to that many programs, their float32
    partials summed in order by the last of them, which adds the residual, and the LoRA where x @ A.T is computed
    once (`lora_a_stacked`); with A per program each program adds its K's share of x @ A.T times B to its
    partial. It needs `split_counters`, int32 zeros on x's device with one entry a tile (`SPLIT_COUNTERS` covers
    the decoder's launches), owned by the call site and left zeroed; without them K is not split. `pair` (None:
    the tiles' choice): gate's and up's weight tiles in one loop. `max_registers` (None: ptxas' choice): the
    most registers a thread of the launch may take (ptxas' maxnreg), so that more of its programs fit on an SM at
    once.
    """
    k = weights[0].k
    default = tile_config(x.shape[0], x.is_cuda, weights[0].dense, silu_mul, weights[0].lora_a is not None,
                          len(weights))
    if product is not None:  # a caller naming its product names its tiles: no swap, stages or A per program implied
        default = Tiles(product, default.block_n, default.block_k)
    product = default.product
    block_n = default.block_n if block_n is None else block_n
    block_k = default.block_k if block_k is None else block_k
    swap = default.swap if swap is None else swap
    num_stages = default.num_stages if num_stages is None else num_stages
    a_per_program = default.a_per_program if a_per_program is None else a_per_program
    split_k = default.split_k if split_k is None else split_k
    pair = default.pair if pair is None else pair
    first = weights[0]
    rank = 0 if first.lora_a is None else first.lora_a.shape[0]
    if split_counters is None:
        split_k = 1
    if a_per_program:
        lora_a_stacked = None
    broadcast = product in (PRODUCT_BROADCAST, PRODUCT_BROADCAST_AT_ONCE)
    if span_k and broadcast and triton.next_power_of_2(k) > block_k:
        wide = min(SPAN_K_MAX, triton.next_power_of_2(k))
        block_n, block_k = max(1, block_n * block_k // wide), wide
    block_k = min(block_k, max(QUANT_BLOCK, triton.next_power_of_2(k)))  # no tile wider than K needs
    if block_k % QUANT_BLOCK or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two multiple of {QUANT_BLOCK}; got {block_k}")
    if swap and product not in (PRODUCT_DOT32, PRODUCT_TENSOR_CORE):
        raise ValueError(f"swap takes a dot product ({PRODUCT_DOT32} or {PRODUCT_TENSOR_CORE}); got {product}")
    if not 1 <= len(weights) <= 3 or (silu_mul and len(weights) != 2):
        raise ValueError(f"project takes 1-3 weights (2 with silu_mul); got {len(weights)}")
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x must be [B, {k}] with unit column stride; got {tuple(x.shape)}")
    dtype_code(x.dtype)
    for w in weights:
        if w.k != k or w.dense != first.dense or w.nested != first.nested or (w.lora_a is None) != (
                first.lora_a is None):
            raise ValueError("the weights of one launch must share K, their kind and whether they carry LoRA")
        if w.dense and w.data.dtype != x.dtype:
            raise ValueError(f"a dense weight must be in x's dtype {x.dtype}; got {w.data.dtype}")
        if w.lora_a is not None and (w.lora_a.shape != (first.lora_a.shape[0], k) or w.lora_b.shape != (
                w.n, first.lora_a.shape[0])):
            raise ValueError(f"LoRA must be A [r, {k}] and B [N, r] with one r per launch; got "
                             f"{tuple(w.lora_a.shape)}, {tuple(w.lora_b.shape)}")
    if silu_mul and weights[0].n != weights[1].n:
        raise ValueError(f"gate and up must have one width; got {weights[0].n} and {weights[1].n}")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm_weight must be [{k}]; got {tuple(norm_weight.shape)}")
    batch = x.shape[0]
    width = weights[0].n if silu_mul else sum(w.n for w in weights)
    if residual is not None and (residual.shape != (batch, width) or residual.stride(1) != 1):
        raise ValueError(f"residual must be [{batch}, {width}] with unit column stride; got {tuple(residual.shape)}")
    y = torch.empty((batch, width), dtype=x.dtype, device=x.device)
    if x.dtype == torch.float32 and product == PRODUCT_TENSOR_CORE:
        product = PRODUCT_DOT32  # a half-precision dot would round float32 operands
        block_k = min(block_k, 128)  # float32 tiles of the half-precision size overflow shared memory
    block_b = triton.next_power_of_2(batch) if broadcast else 16  # tl.dot's smallest M is 16
    block_b = min(block_b, 16)
    down_k = min(block_k, 1024)  # x @ A.T's programs: 8 ranks of A a program, at most 8 x 1024 in registers
    # and one chunk of K each, up to 4 chunks: a worker reads its one A tile before PDL's wait, so that after it
    # only x is read, once (o_proj's and down_proj's 2 and 3 tiles were read one after another)
    chunks = min(4, triton.cdiv(k, down_k))
    options = launch_options(x.device)
    # x @ A.T once for a launch: on a GPU one row of x and 8 ranks a program (with all 8 rows in a program its
    # broadcast products took ~75 us a launch at 8 rows, benchmarks/results/decode_step_sweep_h200.md); the
    # interpreter takes the fewest programs.
    down_b, down_r = (1, 8) if x.is_cuda else (min(triton.next_power_of_2(batch), 16), 16)
    lora, a_of, stride_xa, workers = (1 if rank else 0), [w.lora_a for w in weights], 0, 0
    xa = a_stacked = None
    if rank and lora_a_stacked is not None:
        if lora_a_stacked.shape != (len(weights) * rank, k) or not lora_a_stacked.is_contiguous():
            raise ValueError(f"lora_a_stacked must be the {len(weights)} A matrices stacked, contiguous "
                             f"[{len(weights) * rank}, {k}]; got {tuple(lora_a_stacked.shape)}")
        stride_xa, a_stacked = lora_a_stacked.shape[0], lora_a_stacked
        xa = torch.empty((batch, chunks, stride_xa), dtype=torch.float32, device=x.device)  # a partial a chunk
        lora, a_of = 2, [xa[:, 0, i * rank:] for i in range(len(weights))]  # each weight's columns of xa
        down_grid = (triton.cdiv(stride_xa, down_r), triton.cdiv(batch, down_b), chunks)
        if lora_sync is not None and batch <= block_b:  # the down programs lead the projection's launch
            if lora_sync.shape != (2,) or lora_sync.dtype != torch.int32 or lora_sync.device != x.device:
                raise ValueError(f"lora_sync must be int32 [2] on {x.device}; got {lora_sync.dtype} "
                                 f"{tuple(lora_sync.shape)} on {lora_sync.device}")
            lora, workers = 3, down_grid[0] * down_grid[1] * down_grid[2]
        else:
            _lora_down[down_grid](
                x, x.stride(0), batch, k, norm_weight if norm_weight is not None else x, eps, lora_a_stacked,
                stride_xa, xa, NORM=norm_weight is not None, DTYPE=dtype_code(x.dtype, x.device), BLOCK_B=down_b,
                BLOCK_R=down_r, BLOCK_K=down_k, CHUNKS=chunks, **options)

    flat = []
    a_of += [a_of[-1]] * (3 - len(weights))
    for i, w in enumerate(weights + [weights[-1]] * (3 - len(weights))):  # unused slots: width 0, never read
        unused = w.data
        flat += [w.data, unused if w.absmax is None else w.absmax, unused if w.absmax2 is None else w.absmax2,
                 w.offset, unused if a_of[i] is None else a_of[i], unused if w.lora_b is None else w.lora_b,
                 w.n if i < len(weights) else 0]
    blocks = triton.cdiv(width, block_n) if silu_mul else sum(triton.cdiv(w.n, block_n) for w in weights)
    k_tiles = triton.cdiv(k, block_k)
    k_split = triton.cdiv(k_tiles, max(1, min(split_k, k_tiles))) * block_k  # columns a program, whole tiles
    split_k = triton.cdiv(k, k_split)
    batch_blocks = triton.cdiv(batch, block_b)
    ws = counters = y
    if split_k > 1:
        if split_counters.dtype != torch.int32 or split_counters.device != x.device \
                or split_counters.numel() < blocks * batch_blocks:
            raise ValueError(f"split_counters must be int32 on {x.device} with at least {blocks * batch_blocks} "
                             f"entries; got {split_counters.dtype} {tuple(split_counters.shape)}")
        counters = split_counters
        ws = torch.empty(blocks * batch_blocks * split_k * 2 * block_b * block_n, dtype=torch.float32,
                         device=x.device)
    grid = (workers + blocks * split_k, batch_blocks)
    code = first.code if first.code is not None else x
    code2 = first.code2 if first.code2 is not None else x
    _project[grid](
        x, x.stride(0), batch, k, norm_weight if norm_weight is not None else x, eps, code, code2, rank, *flat,
        y, y.stride(0), residual if residual is not None else y, 0 if residual is None else residual.stride(0),
        stride_xa, x if a_stacked is None else a_stacked, y if xa is None else xa,
        y if lora_sync is None else lora_sync, workers, ws, counters, k_split,
        PARTS=len(weights), SILU_MUL=silu_mul, DENSE=first.dense, NESTED=first.nested, NORM=norm_weight is not None,
        LORA=lora, RESIDUAL=residual is not None, DTYPE=dtype_code(x.dtype, x.device),
        BLOCK_B=block_b, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=max(16, triton.next_power_of_2(max(rank, 1))),
        PRODUCT=product, SWAP=swap, WAIT_IN_LOOP=swap and num_stages == 1, DOWN_B=down_b, DOWN_R=down_r,
        DOWN_K=down_k, PAIR=pair, SPLIT_K=split_k, CHUNKS=chunks if xa is not None else 1,
        num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
        **({} if max_registers is None or not x.is_cuda else {"maxnreg": max_registers}), **options)
    return y


def stack_lora_a(weights: list[Weight]) -> torch.Tensor | None:
    """The A matrices of one launch's weights stacked [len * r, K] for `project(lora_a_stacked=...)`; None
    without LoRA."""
    if weights[0].lora_a is None:
        return None
    return torch.cat([w.lora_a for w in weights]).contiguous()
