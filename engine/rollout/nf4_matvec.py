"""residual + RMSNorm(x) @ W.T + LoRA for a bitsandbytes NF4 weight, dequantized in registers (one kernel).

A building block for the decode kernels of issue 11 (nothing calls it yet:
it lands with its float64 tests ahead of the engine that will, whose speed is
to be measured on a GPU). The weight is the very tensor the training step
uses (`bnb.nn.Params4bit` data and its `QuantState`): no second copy, no
re-quantization.

bitsandbytes' NF4 layout, for a [N, K] weight flattened row-major: byte i
holds element 2i in its high nibble and 2i+1 in its low one; each nibble
indexes the 16-entry NF4 code; every 64 elements share one absmax. With
double quantization (`compress_statistics`) each absmax is itself a uint8 into
a 256-entry code, scaled by a float32 per 256 absmaxes, plus an offset:

    W[e] = code[nibble(e)] * absmax(e // 64)
    absmax(a) = code2[absmax_u8[a]] * absmax2[a // 256] + offset      (nested)

Options fuse what surrounds a decoder projection: an RMSNorm of x before it
(Qwen3's input and post-attention norms before q/k/v and gate/up), the LoRA
adapter beside it (x @ A.T is accumulated along K with the product, then
multiplied by B in the epilogue) and a residual add after it (o_proj, down_proj).

Each program computes BLOCK_N outputs for up to BLOCK_B rows of x: it walks K
in BLOCK_K steps, splitting x into its even and odd columns so the high and
low nibbles multiply their own halves. Weights are rounded to x's dtype as
bitsandbytes' dequantize rounds them (and a fused RMSNorm rounds as Qwen3's
does), then multiplied and summed in float32 (IEEE, not TF32: Triton's CPU
interpreter has no bf16 matmul; on a GPU a bf16 tensor-core dot is the
obvious next step, to be measured).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

QUANT_BLOCK = 64  # elements per absmax: the only NF4 block size this kernel reads
NESTED_BLOCK = 256  # absmaxes per second-level scale (bitsandbytes' double quantization)


@triton.jit
def _round(v, BF16: tl.constexpr):
    """float32 v rounded to the compute dtype (to nearest, ties to even) and back; bf16 by its bits, since
    Triton's CPU interpreter truncates a bf16 cast where the GPU rounds."""
    if BF16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return v.to(tl.float16).to(tl.float32)


@triton.jit
def _nf4_matvec(x_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, code_ptr, offset, y_ptr,
                norm_ptr, eps, a_ptr, b_ptr, lora_scale, r, residual_ptr,
                B, N, K, stride_xb, stride_yb, stride_rb,
                NESTED: tl.constexpr, NORM: tl.constexpr, LORA: tl.constexpr, RESIDUAL: tl.constexpr, BF16: tl.constexpr,
                BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    batch = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    half = tl.arange(0, BLOCK_K // 2)
    row_ok = rows < N
    batch_ok = batch < B
    x_base = x_ptr + batch[:, None].to(tl.int64) * stride_xb
    if NORM:  # RMSNorm's 1 / rms of each row of x, float32, before the projection reads x
        squares = tl.zeros((BLOCK_B,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_base + cols[None, :], mask=batch_ok[:, None] & (cols[None, :] < K), other=0.0).to(tl.float32)
            squares += tl.sum(v * v, axis=1)
        inv_rms = 1.0 / tl.sqrt(squares / K + eps)
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
    xa = tl.zeros((BLOCK_B, BLOCK_R), dtype=tl.float32)  # LoRA: x @ A.T, accumulated along K with the product
    for k0 in range(0, K, BLOCK_K):
        col = k0 + 2 * half  # the even column of each byte
        col_ok = col < K
        odd_ok = col + 1 < K
        element = rows[:, None].to(tl.int64) * K + col[None, :]  # [BLOCK_N, BLOCK_K / 2]
        w_ok = row_ok[:, None] & col_ok[None, :]
        packed = tl.load(packed_ptr + element // 2, mask=w_ok, other=0).to(tl.int32)
        scale_index = element // 64
        if NESTED:
            quantized = tl.load(absmax_ptr + scale_index, mask=w_ok, other=0).to(tl.int32)
            scale = tl.load(code2_ptr + quantized) * tl.load(absmax2_ptr + scale_index // 256, mask=w_ok, other=0.0)
            scale = scale + offset
        else:
            scale = tl.load(absmax_ptr + scale_index, mask=w_ok, other=0.0)
        # Rounded to x's dtype as bitsandbytes' dequantize rounds them: the same weights its matmul uses.
        w_even = _round(tl.load(code_ptr + (packed >> 4)) * scale, BF16)
        w_odd = _round(tl.load(code_ptr + (packed & 15)) * scale, BF16)
        x_ok = batch_ok[:, None] & col_ok[None, :]
        x_even = tl.load(x_base + col[None, :], mask=x_ok, other=0.0).to(tl.float32)
        x_odd = tl.load(x_base + col[None, :] + 1, mask=x_ok & odd_ok[None, :], other=0.0).to(tl.float32)
        if NORM:  # as Qwen3RMSNorm rounds: normalized x to x's dtype, then times the weight, rounded again
            g_even = tl.load(norm_ptr + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            g_odd = tl.load(norm_ptr + col + 1, mask=odd_ok, other=0.0).to(tl.float32)[None, :]
            x_even = _round(_round(x_even * inv_rms[:, None], BF16) * g_even, BF16)
            x_odd = _round(_round(x_odd * inv_rms[:, None], BF16) * g_odd, BF16)
        acc += tl.dot(x_even, tl.trans(w_even), input_precision="ieee")
        acc += tl.dot(x_odd, tl.trans(w_odd), input_precision="ieee")
        if LORA:  # A is [r, K]: its even and odd columns meet x's
            a_rows = a_ptr + ranks[:, None] * K
            a_ok = ranks[:, None] < r
            a_even = tl.load(a_rows + col[None, :], mask=a_ok & col_ok[None, :], other=0.0).to(tl.float32)
            a_odd = tl.load(a_rows + col[None, :] + 1, mask=a_ok & odd_ok[None, :], other=0.0).to(tl.float32)
            xa += tl.dot(x_even, tl.trans(a_even), input_precision="ieee")
            xa += tl.dot(x_odd, tl.trans(a_odd), input_precision="ieee")
    if LORA:  # B is [N, r]
        b_tile = tl.load(b_ptr + rows[:, None] * r + ranks[None, :], mask=row_ok[:, None] & (ranks[None, :] < r),
                         other=0.0).to(tl.float32)
        acc += lora_scale * tl.dot(xa, tl.trans(b_tile), input_precision="ieee")
    out_ok = batch_ok[:, None] & row_ok[None, :]
    if RESIDUAL:
        acc += tl.load(residual_ptr + batch[:, None].to(tl.int64) * stride_rb + rows[None, :], mask=out_ok,
                       other=0.0).to(tl.float32)
    out = y_ptr + batch[:, None].to(tl.int64) * stride_yb + rows[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=out_ok)


def nf4_matvec(x: torch.Tensor, packed: torch.Tensor, state, *, norm_weight: torch.Tensor | None = None,
               eps: float = 1e-6, lora: tuple[torch.Tensor, torch.Tensor, float] | None = None,
               residual: torch.Tensor | None = None, block_n: int = 64, block_k: int = 128) -> torch.Tensor:
    """residual + norm(x) @ W.T + scale * (norm(x) @ A.T) @ B.T -> [B, N] in x's dtype.

    W is the NF4 weight `packed` (uint8) with its bitsandbytes QuantState; `norm_weight`: an RMSNorm of x
    first (float32 statistics, as Qwen3's); `lora`: (A [r, K], B [N, r], alpha / r); `residual`: [B, N].
    """
    n, k = state.shape
    if state.blocksize != QUANT_BLOCK or getattr(state, "quant_type", "nf4") != "nf4":
        raise ValueError(f"needs NF4 with block size {QUANT_BLOCK}; got {state.quant_type} / {state.blocksize}")
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bf16 or fp16 [B, {k}] with unit column stride; got {tuple(x.shape)} {x.dtype}")
    if packed.dtype != torch.uint8 or packed.numel() * 2 != n * k:
        raise ValueError(f"packed must hold {n * k // 2} uint8 bytes; got {packed.numel()} {packed.dtype}")
    nested = bool(state.nested)
    if nested and state.state2.blocksize != NESTED_BLOCK:
        raise ValueError(f"needs nested absmax blocks of {NESTED_BLOCK}; got {state.state2.blocksize}")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm_weight must be [{k}]; got {tuple(norm_weight.shape)}")
    a = b = None
    rank, lora_scale = 0, 0.0
    if lora is not None:
        a, b, lora_scale = lora
        rank = a.shape[0]
        if a.shape != (rank, k) or b.shape != (n, rank) or not (a.is_contiguous() and b.is_contiguous()):
            raise ValueError(f"lora must be A [r, {k}] and B [{n}, r], contiguous; got {tuple(a.shape)}, "
                             f"{tuple(b.shape)}")
    batch = x.shape[0]
    if residual is not None and (residual.shape != (batch, n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be [{batch}, {n}] with unit column stride; got {tuple(residual.shape)}")
    y = torch.empty((batch, n), dtype=x.dtype, device=x.device)
    block_b = 16  # tl.dot's smallest M; rows past B are masked
    absmax2 = state.state2.absmax if nested else state.absmax
    code2 = state.state2.code if nested else state.code
    offset = float(state.offset) if nested else 0.0
    unused = state.code  # any tensor stands in for an operand a disabled stage never reads
    grid = (triton.cdiv(n, block_n), triton.cdiv(batch, block_b))
    _nf4_matvec[grid](
        x, packed.view(-1), state.absmax, absmax2, code2, state.code, offset, y,
        unused if norm_weight is None else norm_weight, eps, unused if a is None else a, unused if b is None else b,
        float(lora_scale), rank, unused if residual is None else residual,
        batch, n, k, x.stride(0), y.stride(0), 0 if residual is None else residual.stride(0),
        NESTED=nested, NORM=norm_weight is not None, LORA=lora is not None, RESIDUAL=residual is not None,
        BF16=x.dtype == torch.bfloat16,
        BLOCK_B=block_b, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=max(16, triton.next_power_of_2(max(rank, 1))))
    return y
