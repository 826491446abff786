"""Weights asked into L2 ahead of the launch that reads them: Hopper's bulk prefetch, issued by the decode kernels.

A decode step's launches are short, and most of each one's time is not its
weight bytes but its latency: the launch, the wait on the kernel before, a few
dependent reads. While the split-key attention runs (a few microseconds a layer
over a small cache) the memory is nearly idle, and the projections that follow
it read their weights from device memory only once they start. With
`prefetch` a launch's programs first ask L2 (50 MB on an H200) for other
tensors' bytes (`cp.async.bulk.prefetch.L2`, sm_90: issued, never waited on,
no registers held), each program its share, so that a later launch finds its
weights there. A prefetch changes no result, only where the bytes come from.

`fused_step.decode_step` says which launch asks for which weights
(`fused_step.PREFETCH`); Triton's interpreter and GPUs before Hopper take none.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_RANGES = 4  # tensors one launch may prefetch (the kernels' pf0..pf3 arguments)


@triton.jit
def _bulk_prefetch(addresses, sizes):
    """One bulk L2 prefetch per element: `sizes` bytes (a multiple of 16; 0 issues nothing) at `addresses`."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addresses, sizes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_share(ptr, nbytes, part, parts, CHUNKS: tl.constexpr):
    """Program `part` of `parts` prefetches its share of the `nbytes` at `ptr` (16-byte aligned) into L2: CHUNKS
    pieces, one a thread (CHUNKS = 32 x the warps, so that no piece is issued twice); a last partial 16 bytes
    are left out."""
    chunk = tl.cdiv(tl.cdiv(nbytes, parts * CHUNKS), 16) * 16
    starts = (part * CHUNKS + tl.arange(0, CHUNKS)).to(tl.int64) * chunk
    sizes = (tl.minimum(tl.maximum(nbytes - starts, 0), chunk) // 16 * 16).to(tl.int32)
    _bulk_prefetch((ptr.to(tl.pointer_type(tl.int8)) + starts).to(tl.int64, bitcast=True), sizes)


@triton.jit
def prefetch_ranges(pf0, pf_n0, pf1, pf_n1, pf2, pf_n2, pf3, pf_n3, part, parts, RANGES: tl.constexpr,
                    CHUNKS: tl.constexpr):
    """This program's share of each of the first RANGES tensors (`prefetch_args`)."""
    if RANGES > 0:
        prefetch_share(pf0, pf_n0, part, parts, CHUNKS)
    if RANGES > 1:
        prefetch_share(pf1, pf_n1, part, parts, CHUNKS)
    if RANGES > 2:
        prefetch_share(pf2, pf_n2, part, parts, CHUNKS)
    if RANGES > 3:
        prefetch_share(pf3, pf_n3, part, parts, CHUNKS)


def supported(device: torch.device) -> bool:
    """Whether kernels on `device` issue prefetches: CUDA of compute capability 9 or later (not the interpreter)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def prefetch_args(tensors: list[torch.Tensor] | None, filler: torch.Tensor, num_warps: int) -> tuple[list, dict]:
    """The kernels' pf0, pf_n0 .. pf3, pf_n3 arguments and their RANGES / PF_CHUNKS constexprs for `tensors` (each
    contiguous, read whole), `filler` (any tensor on the launch's device) in the unused places; none where that
    device does not support it. ValueError past `MAX_RANGES`."""
    device = filler.device
    tensors = list(tensors or []) if supported(device) else []
    if len(tensors) > MAX_RANGES:
        raise ValueError(f"a launch prefetches at most {MAX_RANGES} tensors; got {len(tensors)}")
    args: list = []
    for t in tensors:
        if not t.is_contiguous() or t.device != device:
            raise ValueError(f"a prefetched tensor must be contiguous on {device}; got {tuple(t.shape)} on {t.device}")
        args += [t, t.numel() * t.element_size()]
    args += [filler, 0] * (MAX_RANGES - len(tensors))
    return args, {"RANGES": len(tensors), "PF_CHUNKS": 32 * num_warps}
