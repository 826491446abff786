"""One decode step's attention over the static KV cache, in Triton: its prologue and the split-key attention.

`qk_norm_rope_append` takes the qkv projection's output to q and the new cache
entries (q_norm, k_norm, rotary embedding, append); `decode_attention` attends,
split along the keys (flash-decoding). The kernel step (fused_step.py) takes
both in `attend_new_token`, whose split-key programs do the prologue themselves
(one launch fewer a layer, the same bits). Measured on an H200
(benchmarks/results/decode_kernels_h200_session4.md) it takes 8.0 us at one slot
against SDPA's 12.0 over the masked cache, and 23.5 against 16.5 at eight. The
cache is the CUDA-graph decoder's (`cuda_graph.StaticDecoder`): [slots,
kv_heads, max_len, head_dim] for one layer, each slot attending to its keys
0..position inclusive, so slots at different lengths share one launch and no
mask tensor exists.

Pass 1, one program per (slot, kv head, key split): the query heads that share
the kv head (grouped-query attention) take their scores against the split's
keys, and keep the split's max, sum of exponentials and weighted values
(broadcast products: with two query heads per kv head a dot would pad them to 16
rows). Pass 2, one program per (slot, query head): the splits combined by their
maxima; or, with `counters`, by the last split-key program to finish for each
(slot, kv head), in the same launch (the same bits; measured slower in the step
on an H200, so the step does not pass them). With short contexts (704 tokens)
and batch 1 there are only kv_heads slots x heads of work; the split gives the
SMs enough programs (`split_keys`: at one slot splits of 16 keys, since the
programs' own latency, not their bytes, is what the step waits for). All
softmax arithmetic is float32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from miniverl.engine.rollout.decode_projection import (dtype_code, gdc_launch_dependents, gdc_wait,
                                                       launch_options, round_to_dtype)

COUNTERS = 4096  # `decode_attention(counters=...)` entries a call site allocates: slots x kv heads


@triton.jit
def _normed_rotated(offsets, qkv_ptr, partner_offsets, weight_ptr, dims, partner, cos, sin, eps,
                    HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr):
    """Rows of q or k heads from the qkv projection's output at `offsets` [M, D] (`partner_offsets`: rotate_half's
    partner of each element): q_norm / k_norm as Qwen3RMSNorm rounds (normalized, rounded, times the weight,
    rounded), then the rotary embedding as the module step computes it, round(round(x * cos) + partner * sin)."""
    x = tl.load(qkv_ptr + offsets).to(tl.float32)
    x_partner = tl.load(qkv_ptr + partner_offsets).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=1, keep_dims=True) / HEAD_DIM + eps)
    x = round_to_dtype(round_to_dtype(x * inv_rms, DTYPE) * tl.load(weight_ptr + dims).to(tl.float32)[None, :],
                       DTYPE)
    x_partner = round_to_dtype(round_to_dtype(x_partner * inv_rms, DTYPE)
                               * tl.load(weight_ptr + partner).to(tl.float32)[None, :], DTYPE)
    return round_to_dtype(round_to_dtype(x * cos, DTYPE) + x_partner * sin, DTYPE)


@triton.jit
def _attend_tile(q, k, v, key_ok, running_max, running_sum, acc, scale, DOT: tl.constexpr):
    """The online softmax over one tile of keys: the running max, sum of exponentials and weighted values."""
    if DOT:  # 16 or more query heads share the kv head: a dot's rows are all used
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_G, BLOCK_L]
    else:  # a few: broadcast products, no rows padded to a dot's 16
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
    scores = tl.where(key_ok[None, :], scores, -float("inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    rescale = tl.exp(running_max - new_max)
    weights = tl.exp(scores - new_max[:, None])
    running_sum = running_sum * rescale + tl.sum(weights, axis=1)
    if DOT:
        acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision="ieee")
    else:
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
    return new_max, running_sum, acc


@triton.jit
def _split_attention(q_ptr, k_ptr, v_ptr, positions_ptr, max_ptr, sum_ptr, acc_ptr, scale,
                     stride_qs, stride_qh, stride_ks, stride_kh, stride_kl, n_splits, split_len,
                     q_weight_ptr, k_weight_ptr, eps, cos_ptr, sin_ptr, count_ptr, out_ptr, stride_os, stride_oh,
                     GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_L: tl.constexpr,
                     DOT: tl.constexpr, PROLOGUE: tl.constexpr, N_Q: tl.constexpr, DTYPE: tl.constexpr,
                     COMBINE: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    """Pass 1. PROLOGUE: q_ptr is the qkv projection's output [S, (H + 2 Hkv) D], not q: every program takes its
    query heads through q_norm and the rotary embedding (`_normed_rotated`) and the new key likewise, and the one
    whose split holds the slot's position appends the new key and value to the caches.

    Under PDL the split's first tile of keys older than the position is read before the wait (earlier steps
    wrote it; positions and the rotary tables are the graph's inputs): after the wait only q and the newest key
    and value are read, from the kernel before, and that key takes its place in the tile in registers.

    A split past the slot's last key has nothing to attend to: its program ends at once (the combine reads only
    the splits that hold keys). COMBINE: the program that arrives last at its (slot, kv head)'s counter combines
    the splits of its query heads into out_ptr (`_combined`, as `_combine` does) and zeroes the counter for the
    next launch: one launch instead of two."""
    if PDL:
        gdc_launch_dependents()
    slot = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    heads = kv_head * GROUP + tl.arange(0, BLOCK_G)
    head_ok = tl.arange(0, BLOCK_G) < GROUP
    dims = tl.arange(0, HEAD_DIM)
    last = tl.load(positions_ptr + slot)  # keys 0..last are this slot's
    start = split * split_len
    if start <= last:  # else no key of the slot is in this split: nothing to attend, store or count
        stop = tl.minimum(start + split_len, last + 1)
        base = slot * stride_ks + kv_head * stride_kh
        keys = start + tl.arange(0, BLOCK_L)
        older = (keys < stop) & (keys < last)
        offsets = base + keys[:, None] * stride_kl + dims[None, :]
        k = tl.load(k_ptr + offsets, mask=older[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offsets, mask=older[:, None], other=0.0).to(tl.float32)
        if PROLOGUE:
            partner = (dims + HEAD_DIM // 2) % HEAD_DIM  # rotate_half pairs d with d + D/2 (its sign is in the sin table)
            cos = tl.load(cos_ptr + last * HEAD_DIM + dims).to(tl.float32)[None, :]
            sin = tl.load(sin_ptr + last * HEAD_DIM + dims).to(tl.float32)[None, :]
        entry = base + last * stride_kl + dims[None, :]  # the newest key's and value's place in the caches
        if PDL:  # q and the newest key come from the kernel before
            gdc_wait()
        if PROLOGUE:
            row = slot * stride_qs
            q_heads = tl.where(head_ok, heads, kv_head * GROUP)  # padded rows repeat a real head, never stored
            q = _normed_rotated(row + q_heads[:, None] * HEAD_DIM + dims[None, :], q_ptr,
                                row + q_heads[:, None] * HEAD_DIM + partner[None, :], q_weight_ptr, dims, partner, cos,
                                sin, eps, HEAD_DIM, DTYPE)
            q = tl.where(head_ok[:, None], q, 0.0)
            k_row = row + (N_Q + kv_head) * HEAD_DIM
            newest_k = _normed_rotated(k_row + dims[None, :], q_ptr, k_row + partner[None, :], k_weight_ptr, dims,
                                       partner, cos, sin, eps, HEAD_DIM, DTYPE)  # [1, D]
            newest_v = tl.load(q_ptr + row + (N_Q + tl.num_programs(1) + kv_head) * HEAD_DIM + dims[None, :])
            holds = (dims[None, :] * 0 + last // split_len) == split  # this split holds the new key: append it
            tl.store(k_ptr + entry, newest_k.to(k_ptr.dtype.element_ty), mask=holds)
            tl.store(v_ptr + entry, newest_v, mask=holds)
            # as the cache holds them, read back
            newest_k = newest_k.to(k_ptr.dtype.element_ty).to(tl.float32)
            newest_v = newest_v.to(tl.float32)
        else:  # appended by the kernel before
            q = tl.load(q_ptr + slot * stride_qs + heads[:, None] * stride_qh + dims[None, :], mask=head_ok[:, None],
                        other=0.0).to(tl.float32)
            newest_k = tl.load(k_ptr + entry).to(tl.float32)
            newest_v = tl.load(v_ptr + entry).to(tl.float32)
        running_max = tl.full((BLOCK_G,), -float("inf"), dtype=tl.float32)
        running_sum = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, HEAD_DIM), dtype=tl.float32)
        is_newest = (keys == last)[:, None]
        running_max, running_sum, acc = _attend_tile(q, tl.where(is_newest, newest_k, k),
                                                     tl.where(is_newest, newest_v, v), keys < stop, running_max,
                                                     running_sum, acc, scale, DOT)
        for l0 in range(start + BLOCK_L, stop, BLOCK_L):  # splits longer than a tile
            later = l0 + tl.arange(0, BLOCK_L)
            later_ok = later < stop
            later_offsets = base + later[:, None] * stride_kl + dims[None, :]
            later_newest = (later == last)[:, None]
            later_k = tl.load(k_ptr + later_offsets, mask=later_ok[:, None] & ~later_newest, other=0.0)
            later_v = tl.load(v_ptr + later_offsets, mask=later_ok[:, None] & ~later_newest, other=0.0)
            running_max, running_sum, acc = _attend_tile(
                q, tl.where(later_newest, newest_k, later_k.to(tl.float32)),
                tl.where(later_newest, newest_v, later_v.to(tl.float32)), later_ok, running_max, running_sum, acc,
                scale, DOT)
        partial = (slot * tl.num_programs(1) * GROUP + heads) * n_splits + split  # [slot, head, split]
        tl.store(max_ptr + partial, running_max, mask=head_ok)
        tl.store(sum_ptr + partial, running_sum, mask=head_ok)
        tl.store(acc_ptr + partial[:, None] * HEAD_DIM + dims[None, :], acc, mask=head_ok[:, None])
        if COMBINE:
            live = last // split_len + 1  # the splits that hold keys, each of whose programs arrives once
            counter = count_ptr + slot * tl.num_programs(1) + kv_head
            tl.debug_barrier()  # the whole program's partials before the release
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            tl.debug_barrier()  # and the last program's reads of the others' after its acquire
            if arrived == live - 1:
                for g in tl.static_range(GROUP):
                    head = kv_head * GROUP + g
                    value = _combined(max_ptr, sum_ptr, acc_ptr, (slot * N_Q + head) * n_splits, live, HEAD_DIM,
                                      BLOCK_S)
                    tl.store(out_ptr + slot * stride_os + head * stride_oh + dims, value.to(out_ptr.dtype.element_ty))
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _combined(max_ptr, sum_ptr, acc_ptr, row, live, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    """One query head's attention [HEAD_DIM] (float32) from its first `live` splits' partials at row, row + 1, ..:
    their weighted values, each split weighted by exp(its max - the largest), over the weighted sums. Read past
    L1 (`.cg`): in the split-key launch the other programs wrote them."""
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < live
    maxima = tl.load(max_ptr + row + splits, mask=split_ok, other=-float("inf"), cache_modifier=".cg")
    top = tl.max(maxima, axis=0)
    weight = tl.where(split_ok, tl.exp(maxima - top), 0.0)
    total = tl.sum(weight * tl.load(sum_ptr + row + splits, mask=split_ok, other=0.0, cache_modifier=".cg"), axis=0)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(acc_ptr + (row + splits[:, None]) * HEAD_DIM + dims[None, :], mask=split_ok[:, None], other=0.0,
                  cache_modifier=".cg")
    return tl.sum(weight[:, None] * acc, axis=0) / total


@triton.jit
def _combine(max_ptr, sum_ptr, acc_ptr, out_ptr, positions_ptr, split_len, n_splits, stride_os, stride_oh, n_heads,
             HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    """Pass 2 as a launch of its own: one program per (slot, query head)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    slot = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    live = tl.load(positions_ptr + slot) // split_len + 1
    value = _combined(max_ptr, sum_ptr, acc_ptr, (slot * n_heads + head) * n_splits, live, HEAD_DIM, BLOCK_S)
    dims = tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + slot * stride_os + head * stride_oh + dims, value.to(out_ptr.dtype.element_ty))


@triton.jit
def _qk_norm_rope_append(qkv_ptr, stride_qkv, q_weight_ptr, k_weight_ptr, eps, cos_ptr, sin_ptr, positions_ptr,
                         q_ptr, stride_qs, k_cache_ptr, v_cache_ptr, stride_ks, stride_kh, stride_kl,
                         N_Q: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr,
                         PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    slot = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads, then k heads, then v heads, as the qkv projection lays them out
    dims = tl.arange(0, HEAD_DIM)
    partner = (dims + HEAD_DIM // 2) % HEAD_DIM  # rotate_half pairs d with d + D/2 (its sign is in the sin table)
    row = qkv_ptr + slot * stride_qkv + head * HEAD_DIM
    position = tl.load(positions_ptr + slot)
    kv_offset = slot * stride_ks + position * stride_kl
    if head < N_Q + N_KV:
        if head < N_Q:
            weight_ptr = q_weight_ptr
        else:
            weight_ptr = k_weight_ptr
        cos = tl.load(cos_ptr + position * HEAD_DIM + dims).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + position * HEAD_DIM + dims).to(tl.float32)[None, :]
        rotated = _normed_rotated(dims[None, :], row, partner[None, :], weight_ptr, dims, partner, cos, sin, eps,
                                  HEAD_DIM, DTYPE)
        if head < N_Q:
            tl.store(q_ptr + slot * stride_qs + head * HEAD_DIM + dims[None, :], rotated.to(q_ptr.dtype.element_ty))
        else:
            tl.store(k_cache_ptr + kv_offset + (head - N_Q) * stride_kh + dims[None, :],
                     rotated.to(k_cache_ptr.dtype.element_ty))
    else:
        tl.store(v_cache_ptr + kv_offset + (head - N_Q - N_KV) * stride_kh + dims, tl.load(row + dims))


def qk_norm_rope_append(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                        cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor) -> torch.Tensor:
    """From the qkv projection's output [S, (H + 2 Hkv) D]: q_norm and k_norm, the rotary embedding at each slot's
    position, the new key and value written into the caches [S, Hkv, L, D] there; returns q [S, H, D].

    `cos` and `sin` are [L, D] tables in the compute dtype, as the model's rotary embedding gives them for
    positions 0..L-1, with rotate_half's sign folded into `sin` (its first half negated).
    """
    heads = _query_heads(qkv, cos, sin, k_cache, v_cache)
    slots, kv_heads, head_dim = qkv.shape[0], k_cache.shape[1], k_cache.shape[3]
    q = torch.empty((slots, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    _qk_norm_rope_append[(slots, heads + 2 * kv_heads)](
        qkv, qkv.stride(0), q_weight, k_weight, eps, cos, sin, positions, q, q.stride(0), k_cache, v_cache,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        N_Q=heads, N_KV=kv_heads, HEAD_DIM=head_dim, DTYPE=dtype_code(qkv.dtype, qkv.device),
        **launch_options(qkv.device))
    return q


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     split_len: int | None = None, block_l: int | None = None, num_warps: int = 4,
                     counters: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v per slot over keys 0..positions[slot]: q [S, H, D], caches [S, Hkv, L, D] -> [S, H, D].

    By default (`split_keys`) one slot takes splits of 16 keys read at once, more slots splits of 32 read 32 at
    a time up to 4 slots and 16 beyond. `counters`: int32 zeros on q's device, at least S x Hkv (`COUNTERS`
    suits up to 512 slots of 8 kv heads), owned by the call site and left zeroed (a CUDA graph replays them):
    with them the splits are combined in the split-key launch by the last program of each (slot, kv head),
    one launch instead of two, the same bits.
    """
    return _attention(q, k_cache, v_cache, positions, split_len, block_l, num_warps=num_warps, counters=counters)


def attend_new_token(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                     cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, split_len: int | None = None, block_l: int | None = None,
                     num_warps: int = 4, counters: torch.Tensor | None = None) -> torch.Tensor:
    """`qk_norm_rope_append` and `decode_attention` in two launches instead of three (one with `counters`, as
    `decode_attention` takes them): the split-key programs take q and the new key from the qkv projection's
    output themselves, and the one whose split holds the slot's position appends the key and value. The same
    arguments as `qk_norm_rope_append`, the same result as the two (the same bits: the same roundings in one
    helper) and the same caches after it; returns [S, H, D]."""
    heads = _query_heads(qkv, cos, sin, k_cache, v_cache)
    head_dim = k_cache.shape[3]
    return _attention(qkv.view(qkv.shape[0], -1, head_dim), k_cache, v_cache, positions, split_len, block_l,
                      prologue=(q_weight, k_weight, eps, cos, sin), heads=heads, num_warps=num_warps,
                      counters=counters)


def split_keys(slots: int) -> tuple[int, int]:
    """(keys a split, keys a program reads at once) for `slots` slots. The split-key programs' time is their
    own latency, not the bytes (about 1% of the step's), so at one slot more, shorter programs win: splits of
    16 took the kernel step at Qwen3-0.6B's shape from 1.049 to 0.976 ms over 704 keys (bf16, one H200), 1.005
    to 0.933 over 192, and NF4 1.320 to 1.223; at eight slots they were slower over 704 keys (2.685 against
    2.541), so more slots keep splits of 32 (benchmarks/results/decode_step_sweep_h200.md, session 10). Up to 4
    slots those are read 32 keys at a time, beyond 16 (benchmarks/results/decode_attention_h200_broadcast.json)."""
    if slots == 1:
        return 16, 16
    return 32, (32 if slots <= 4 else 16)


def _query_heads(qkv, cos, sin, k_cache, v_cache) -> int:
    """The query heads in the qkv projection's output [S, (H + 2 Hkv) D], once it is checked against the caches
    and the rotary tables; ValueError otherwise."""
    slots, width = qkv.shape
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    heads = width // head_dim - 2 * kv_heads
    if heads <= 0 or width % head_dim or qkv.stride(1) != 1 or k_cache.stride() != v_cache.stride() \
            or k_cache.shape[0] != slots or k_cache.stride(3) != 1 or head_dim & (head_dim - 1):
        raise ValueError(f"qkv [{slots}, {width}] does not match caches {tuple(k_cache.shape)}")
    if cos.shape != (k_cache.shape[2], head_dim) or sin.shape != cos.shape or not (cos.is_contiguous()
                                                                                     and sin.is_contiguous()):
        raise ValueError(f"cos and sin must be contiguous [{k_cache.shape[2]}, {head_dim}]; got {tuple(cos.shape)}")
    return heads


def _attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
               split_len: int | None, block_l: int | None, prologue: tuple | None = None,
               heads: int | None = None, num_warps: int = 4, counters: torch.Tensor | None = None) -> torch.Tensor:
    """Both passes; with `prologue` (q_weight, k_weight, eps, cos, sin) q is the qkv output as [S, heads + 2 Hkv,
    D] and the first `heads` of it are the query heads; `num_warps`: the split-key programs'; with `counters`
    the second pass runs in the split-key launch (`_split_attention(COMBINE)`)."""
    slots, _, head_dim = q.shape
    heads = q.shape[1] if heads is None else heads
    default_split, default_block = split_keys(slots)
    split_len = default_split if split_len is None else split_len
    block_l = default_block if block_l is None else block_l
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[0] != slots or k_cache.shape[3] != head_dim:
        raise ValueError(f"caches must be [{slots}, kv_heads, max_len, {head_dim}] alike; got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    if heads % kv_heads or head_dim & (head_dim - 1) or q.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError(f"needs heads ({heads}) a multiple of kv_heads ({kv_heads}), a power-of-two head_dim "
                         f"({head_dim}) and unit strides on it")
    if k_cache.stride() != v_cache.stride() or positions.shape != (slots,):
        raise ValueError("k and v caches must share strides, and positions must hold one entry per slot")
    group = heads // kv_heads
    block_g = triton.next_power_of_2(group)
    dot = block_g >= 16  # fewer heads per kv head: broadcast products (a dot would pad them to 16 rows)
    options = launch_options(q.device)
    n_splits = triton.cdiv(max_len, split_len)
    partial = torch.empty((slots, heads, n_splits), dtype=torch.float32, device=q.device)
    sums = torch.empty_like(partial)
    acc = torch.empty((slots, heads, n_splits, head_dim), dtype=torch.float32, device=q.device)
    if counters is not None and (counters.dtype != torch.int32 or counters.device != q.device
                                 or counters.numel() < slots * kv_heads):
        raise ValueError(f"counters must be int32 zeros on {q.device}, at least slots x kv_heads "
                         f"({slots * kv_heads}) of them")
    q_weight, k_weight, eps, cos, sin = (q, q, 0.0, q, q) if prologue is None else prologue
    out = torch.empty((slots, heads, head_dim), dtype=q.dtype, device=q.device)
    block_s = triton.next_power_of_2(n_splits)
    _split_attention[(slots, kv_heads, n_splits)](
        q, k_cache, v_cache, positions, partial, sums, acc, 1.0 / math.sqrt(head_dim),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), n_splits, split_len,
        q_weight, k_weight, eps, cos, sin, positions if counters is None else counters, out, out.stride(0),
        out.stride(1), GROUP=group, BLOCK_G=max(16, block_g) if dot else block_g, HEAD_DIM=head_dim,
        BLOCK_L=block_l, DOT=dot, PROLOGUE=prologue is not None, N_Q=heads, DTYPE=dtype_code(q.dtype, q.device),
        COMBINE=counters is not None, BLOCK_S=block_s, num_warps=num_warps, **options)
    if counters is None:
        _combine[(slots, heads)](partial, sums, acc, out, positions, split_len, n_splits, out.stride(0),
                                 out.stride(1), heads, HEAD_DIM=head_dim, BLOCK_S=block_s, **options)
    return out
