"""The `exact` divergence of one chunk of bf16/fp16 logits, and its gradient, in three Triton passes.

The chunked loss builds student logits S [C, V] and teacher logits T [C, V]
with one GEMM each, in the heads' dtype (as `losses._chunk_logits` does). The
unfused path then makes about ten float32 [C, V] temporaries per chunk
(upcasts, log-softmaxes, probabilities, autograd's buffers); here the two
GEMM outputs are the only [C, V] tensors:

    pass 1  per (row, column block): the block's max and sum of exp, for S and T
            (combined into each row's log-sum-exp on the host: C x blocks numbers)
    pass 2  per (row, column block): the divergence's sums (two for the JSD)
    pass 3  per (row, column block): d(value / normalizer) / dS, written over S

so the student's hidden-state gradient is one more GEMM, G @ W. Every sum and
exponential is float32, as in the unfused path; the gradient is rounded to the
logits' dtype, as autograd rounds it there (the backward of the upcast).

Only columns < n_cols (the real vocabulary) take part; padded head rows give
logits that are never read, and their gradient is written as 0, so G @ W over
the whole padded head equals the product over its real rows.

Gradients with respect to the logits (the log-softmax's backward folded in):
    reverse KL  p_s * (log p_s - log p_t - KL(p_s || p_t))
    forward KL  p_s - p_t
    JSD(beta)   (1 - beta) * p_s * (log p_s / m - KL(p_s || m)),  m = beta p_t + (1 - beta) p_s
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # columns per program: 38 blocks per row over Qwen3's 151,936
DIVERGENCES = {"reverse_kl": 0, "forward_kl": 1, "jsd": 2}


@triton.jit
def _block_lse(s_ptr, t_ptr, s_stride, t_stride, n_cols, max_s_ptr, sum_s_ptr, max_t_ptr, sum_t_ptr, n_blocks,
               BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    real = cols < n_cols
    s = tl.load(s_ptr + row * s_stride + cols, mask=real, other=-float("inf")).to(tl.float32)
    t = tl.load(t_ptr + row * t_stride + cols, mask=real, other=-float("inf")).to(tl.float32)
    max_s = tl.max(s, axis=0)
    max_t = tl.max(t, axis=0)
    out = row * n_blocks + block
    tl.store(max_s_ptr + out, max_s)
    tl.store(sum_s_ptr + out, tl.sum(tl.exp(s - max_s), axis=0))
    tl.store(max_t_ptr + out, max_t)
    tl.store(sum_t_ptr + out, tl.sum(tl.exp(t - max_t), axis=0))


@triton.jit
def _log_mixture(logp_s, logp_t, beta):
    """log(beta * p_t + (1 - beta) * p_s), without underflow."""
    a = logp_t + tl.log(beta)
    b = logp_s + tl.log(1.0 - beta)
    top = tl.maximum(a, b)
    return top + tl.log(tl.exp(a - top) + tl.exp(b - top))


@triton.jit
def _block_sums(s_ptr, t_ptr, s_stride, t_stride, n_cols, lse_s_ptr, lse_t_ptr, sum_a_ptr, sum_b_ptr, n_blocks,
                beta, DIVERGENCE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    real = cols < n_cols
    logp_s = tl.load(s_ptr + row * s_stride + cols, mask=real, other=0.0).to(tl.float32) - tl.load(lse_s_ptr + row)
    logp_t = tl.load(t_ptr + row * t_stride + cols, mask=real, other=0.0).to(tl.float32) - tl.load(lse_t_ptr + row)
    p_s = tl.exp(logp_s)
    p_t = tl.exp(logp_t)
    if DIVERGENCE == 0:  # KL(p_s || p_t)
        a = p_s * (logp_s - logp_t)
        b = tl.zeros_like(a)
    elif DIVERGENCE == 1:  # KL(p_t || p_s)
        a = p_t * (logp_t - logp_s)
        b = tl.zeros_like(a)
    else:  # KL(p_t || m) and KL(p_s || m)
        log_m = _log_mixture(logp_s, logp_t, beta)
        a = p_t * (logp_t - log_m)
        b = p_s * (logp_s - log_m)
    out = row * n_blocks + block
    tl.store(sum_a_ptr + out, tl.sum(tl.where(real, a, 0.0), axis=0))
    tl.store(sum_b_ptr + out, tl.sum(tl.where(real, b, 0.0), axis=0))


@triton.jit
def _block_grad(s_ptr, t_ptr, s_stride, t_stride, n_cols, s_cols, lse_s_ptr, lse_t_ptr, kl_ptr, beta, scale,
                DIVERGENCE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    real = cols < n_cols
    logp_s = tl.load(s_ptr + row * s_stride + cols, mask=real, other=0.0).to(tl.float32) - tl.load(lse_s_ptr + row)
    logp_t = tl.load(t_ptr + row * t_stride + cols, mask=real, other=0.0).to(tl.float32) - tl.load(lse_t_ptr + row)
    p_s = tl.exp(logp_s)
    if DIVERGENCE == 0:
        g = p_s * (logp_s - logp_t - tl.load(kl_ptr + row))
    elif DIVERGENCE == 1:
        g = p_s - tl.exp(logp_t)
    else:
        g = (1.0 - beta) * p_s * (logp_s - _log_mixture(logp_s, logp_t, beta) - tl.load(kl_ptr + row))
    g = tl.where(real, g * scale, 0.0)
    tl.store(s_ptr + row * s_stride + cols, g.to(s_ptr.dtype.element_ty), mask=cols < s_cols)


def divergence_and_grad(s_CV: torch.Tensor, t_CV: torch.Tensor, n_cols: int, divergence: str, beta: float,
                        scale: float) -> torch.Tensor:
    """Each row's divergence over columns < n_cols, float32 [C]; S is overwritten by scale * d(sum)/dS.

    S and T are the chunk's student and teacher logits (row-major, unit column
    stride; their row lengths may differ, each at least n_cols).
    """
    if s_CV.stride(1) != 1 or t_CV.stride(1) != 1 or s_CV.shape[0] != t_CV.shape[0]:
        raise ValueError("logits must be row-major with unit column stride and the same number of rows")
    if not 0 < n_cols <= min(s_CV.shape[1], t_CV.shape[1]):
        raise ValueError(f"n_cols {n_cols} must be in [1, {min(s_CV.shape[1], t_CV.shape[1])}]")
    rows = s_CV.shape[0]
    kind = DIVERGENCES[divergence]
    n_blocks = triton.cdiv(n_cols, BLOCK)
    partial = torch.empty((4, rows, n_blocks), dtype=torch.float32, device=s_CV.device)
    strides = (s_CV.stride(0), t_CV.stride(0))
    _block_lse[(rows, n_blocks)](s_CV, t_CV, *strides, n_cols, partial[0], partial[1], partial[2], partial[3],
                                 n_blocks, BLOCK=BLOCK)
    lse_s = torch.logsumexp(partial[0] + partial[1].log(), dim=1)
    lse_t = torch.logsumexp(partial[2] + partial[3].log(), dim=1)
    _block_sums[(rows, n_blocks)](s_CV, t_CV, *strides, n_cols, lse_s, lse_t, partial[0], partial[1], n_blocks,
                                  beta, DIVERGENCE=kind, BLOCK=BLOCK)
    sum_a, sum_b = partial[0].sum(dim=1), partial[1].sum(dim=1)
    if kind == 2:
        value, kl = beta * sum_a + (1.0 - beta) * sum_b, sum_b  # kl: KL(p_s || m), the gradient's centring
    else:
        value, kl = sum_a, sum_a
    _block_grad[(rows, triton.cdiv(s_CV.shape[1], BLOCK))](s_CV, t_CV, *strides, n_cols, s_CV.shape[1], lse_s, lse_t,
                                                           kl.contiguous(), beta, scale, DIVERGENCE=kind, BLOCK=BLOCK)
    return value
