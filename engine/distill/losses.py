"""Distillation losses over the student's LM head, computed and back-propagated chunk by chunk.

objective = (sum over the N gathered positions of loss_i) / normalizer.

The full [N, V] logits never exist: each chunk of `chunk_size` positions builds
its [C, V] logits (and, for `exact`, the teacher's [C, V] logits), adds its
share of the gradient and is freed before the next chunk. Chunking changes
memory, never the value or the gradient.

Only the real vocabulary takes part: the head weights may carry padded rows
(ids >= vocab_limit) that are sliced off before every softmax.

Modes:
- `sampled_kl`: policy gradient on the sampled token, with the per-token
  reward A = -(log p_s(x) - log p_t(x)), the negative reverse-KL estimate.
- `topk_tail`: a divergence between the K+1 bucket distributions made of the
  teacher's top-k ids plus one tail bucket holding the rest of the vocabulary.
- `exact`: a divergence between the full real-vocabulary distributions, the
  teacher's logits rebuilt per chunk from its final hidden states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch import Tensor

# Below this the teacher's tail mass is float32 rounding noise: its top-k
# log-probs carry absolute errors around 1e-7, so 1 - sum(p_topk) cannot
# resolve anything smaller. Clamping also keeps log(tail) finite when the
# top-k probabilities round to a sum of 1 (or a hair above it).
TAIL_EPS = 1e-6

Mode = Literal["sampled_kl", "topk_tail", "exact"]
Divergence = Literal["reverse_kl", "forward_kl", "jsd"]


@dataclass(frozen=True)
class LossSpec:
    mode: Mode
    divergence: Divergence = "reverse_kl"  # topk_tail and exact
    jsd_beta: float = 0.5

    def __post_init__(self) -> None:
        if self.mode not in ("sampled_kl", "topk_tail", "exact"):
            raise ValueError(f"unknown loss mode {self.mode!r}")
        if self.divergence not in ("reverse_kl", "forward_kl", "jsd"):
            raise ValueError(f"unknown divergence {self.divergence!r}")
        # beta in {0, 1} makes the JSD identically zero: no training signal.
        if not 0.0 < self.jsd_beta < 1.0:
            raise ValueError(f"jsd_beta must be in (0, 1), got {self.jsd_beta}")


@dataclass
class PositionTargets:
    """Teacher targets, every tensor indexed by the N gathered positions."""

    token_ids_N: Tensor  # long: the sampled token at each position
    teacher_logprobs_N: Tensor | None = None  # sampled_kl: teacher log p(token)
    topk_ids_NK: Tensor | None = None  # topk_tail: teacher's top-k ids
    topk_logprobs_NK: Tensor | None = None  # topk_tail: their full-vocab-normalised log-probs
    teacher_hidden_NH: Tensor | None = None  # exact: teacher final hidden states (after final norm)
    teacher_head_VH: Tensor | None = None  # exact: teacher lm_head weight (may be padded)


@dataclass
class LossStats:
    loss_sum: float  # sum over positions of loss_i (not divided by the normalizer)
    kl_sum: float  # sum over positions of the per-position KL estimate
    positions: int
    chunks: int


# --------------------------------------------------------------------------- divergences
# Shared by topk_tail (over K+1 buckets) and exact (over the real vocabulary).
# Each takes student and teacher log-probs with the distribution on the last
# dim and returns one value per row. Only the student carries a gradient, and
# its log-probs are always normalised (a log-softmax, or buckets partitioning
# the vocabulary), so any multiple of p_s added to d(loss)/d(log p_s) is zero
# on the simplex. Autograd's literal gradients carry such a multiple, O(1)
# in size (the +p_s from d(p log p), or -(1 - beta) p_s through the JSD
# mixture), which the log-softmax backward then cancels in float32, losing
# digits whenever log(p_s / p_t) is small next to 1 (seen as 5e-6 relative
# gradient error in the tests). So each helper returns its value with the
# centred analytic gradient attached; float64 autograd references check it.


def _with_grad(value_R: Tensor, logp_s_RB: Tensor, grad_RB: Tensor) -> Tensor:
    """`value_R` in the forward pass, d/d(logp_s_RB) = `grad_RB` in the backward."""
    surrogate_R = (grad_RB.detach() * logp_s_RB).sum(dim=-1)
    # (s - s.detach()) is exactly 0.0 forward, so the value is untouched.
    return value_R.detach() + (surrogate_R - surrogate_R.detach())


def _p_and_log_ratio(logp_RB: Tensor, logq_RB: Tensor) -> tuple[Tensor, Tensor]:
    """p and log(p / q), the latter 0 where p == 0 (0 * log 0 = 0, not NaN)."""
    logp_RB, logq_RB = logp_RB.detach(), logq_RB.detach()
    p_RB = logp_RB.exp()
    ratio_RB = torch.where(p_RB > 0, logp_RB - logq_RB, torch.zeros_like(p_RB))
    return p_RB, ratio_RB


def reverse_kl(logp_s: Tensor, logp_t: Tensor) -> Tensor:
    """KL(student || teacher), mode-seeking; gradient p_s * (log p_s/p_t - KL)."""
    p_s, ratio = _p_and_log_ratio(logp_s, logp_t)
    kl = (p_s * ratio).sum(dim=-1)
    return _with_grad(kl, logp_s, p_s * (ratio - kl[..., None]))


def forward_kl(logp_s: Tensor, logp_t: Tensor) -> Tensor:
    """KL(teacher || student), mass-covering; gradient -p_t."""
    p_t, ratio = _p_and_log_ratio(logp_t, logp_s)
    return _with_grad((p_t * ratio).sum(dim=-1), logp_s, -p_t)


def _log_ratio_to_mixture(loga: Tensor, logo: Tensor, w_other: float) -> Tensor:
    """log(a / m) for m = (1 - w_other) * a + w_other * o, from log a and log o.

    = -log((1 - w) + w * e^d) with d = log o - log a. Near agreement (d ~ 0)
    log1p(w * expm1(d)) keeps full relative precision where a log-sum-exp for
    log m would leave an absolute 1e-7 error on an O(d) result; far from it
    the factored form cannot overflow.
    """
    d = logo - loga
    near = -torch.log1p(w_other * torch.expm1(d.clamp(max=1.0)))
    d_far = d.clamp(min=1.0)
    far = -d_far - torch.log(w_other + (1.0 - w_other) * torch.exp(-d_far))
    return torch.where(d <= 1.0, near, far)


def jsd(logp_s: Tensor, logp_t: Tensor, beta: float) -> Tensor:
    """beta * KL(p_t || m) + (1 - beta) * KL(p_s || m), m = beta * p_t + (1 - beta) * p_s.

    Gradient (1 - beta) * p_s * (log p_s/m - KL(p_s || m)): the terms through m cancel.
    """
    ls, lt = logp_s.detach(), logp_t.detach()
    p_s, p_t = ls.exp(), lt.exp()
    zero = torch.zeros_like(p_s)
    ratio_s = torch.where(p_s > 0, _log_ratio_to_mixture(ls, lt, beta), zero)  # log(p_s / m)
    ratio_t = torch.where(p_t > 0, _log_ratio_to_mixture(lt, ls, 1.0 - beta), zero)  # log(p_t / m)
    kl_sm = (p_s * ratio_s).sum(dim=-1)
    value = beta * (p_t * ratio_t).sum(dim=-1) + (1.0 - beta) * kl_sm
    return _with_grad(value, logp_s, (1.0 - beta) * p_s * (ratio_s - kl_sm[..., None]))


def divergence(spec: LossSpec, logp_s: Tensor, logp_t: Tensor) -> Tensor:
    if spec.divergence == "reverse_kl":
        return reverse_kl(logp_s, logp_t)
    if spec.divergence == "forward_kl":
        return forward_kl(logp_s, logp_t)
    return jsd(logp_s, logp_t, spec.jsd_beta)


# --------------------------------------------------------------------------- teacher-score helpers


def _check_ids(ids: Tensor, vocab_limit: int, what: str) -> None:
    # A padded or negative id would silently index a column that is not a real
    # token (or fail as an opaque device assert on GPU): refuse it by name.
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_limit):
        raise ValueError(f"{what} must lie in [0, {vocab_limit}); got range [{int(ids.min())}, {int(ids.max())}]")


def _real_logprobs(logits_CV: Tensor, vocab_limit: int) -> Tensor:
    return torch.log_softmax(logits_CV[:, :vocab_limit].float(), dim=-1)


def token_logprobs(logits_CV: Tensor, token_ids_C: Tensor, vocab_limit: int) -> Tensor:
    """log p(token) under the real-vocabulary softmax of one chunk's logits, float32 [C]."""
    _check_ids(token_ids_C, vocab_limit, "token ids")
    return _real_logprobs(logits_CV, vocab_limit).gather(-1, token_ids_C.long()[:, None]).squeeze(-1)


def teacher_topk(logits_CV: Tensor, k: int, vocab_limit: int) -> tuple[Tensor, Tensor]:
    """The k most likely real tokens per row (descending) and their full-vocab log-probs, float32."""
    if not 0 < k < vocab_limit:
        # k == vocab_limit would leave an empty tail bucket for topk_tail.
        raise ValueError(f"topk k must be in [1, {vocab_limit}), got {k}")
    logprobs_CK, ids_CK = _real_logprobs(logits_CV, vocab_limit).topk(k, dim=-1)
    return ids_CK, logprobs_CK


# --------------------------------------------------------------------------- per-position losses


def _sampled_kl(logits_CV: Tensor, tokens_C: Tensor, teacher_lp_C: Tensor) -> tuple[Tensor, Tensor]:
    logp_s_C = torch.log_softmax(logits_CV, dim=-1).gather(-1, tokens_C[:, None]).squeeze(-1)
    kl_C = logp_s_C.detach() - teacher_lp_C
    advantage_C = -kl_C  # a reward: constant w.r.t. the student, so it is detached
    return -advantage_C * logp_s_C, kl_C


def _student_buckets(logits_CV: Tensor, ids_CK: Tensor) -> Tensor:
    """Student log-probs of the K teacher ids plus the tail bucket, [C, K+1]."""
    lse_C = torch.logsumexp(logits_CV, dim=-1)
    top_CK = logits_CV.gather(-1, ids_CK) - lse_C[:, None]
    # log(1 - sum p_topk) loses everything when the top-k hold nearly all mass;
    # the log-sum-exp over the other logits keeps full relative precision.
    in_topk_CV = torch.zeros_like(logits_CV, dtype=torch.bool).scatter_(-1, ids_CK, True)
    tail_C = torch.logsumexp(logits_CV.masked_fill(in_topk_CV, float("-inf")), dim=-1) - lse_C
    return torch.cat([top_CK, tail_C[:, None]], dim=-1)


def _teacher_buckets(topk_lp_CK: Tensor) -> Tensor:
    """Teacher log-probs of its K ids plus log(max(1 - sum p_topk, TAIL_EPS)), [C, K+1]."""
    # float64 for these K+1 numbers per row (negligible cost): in float32 the
    # rounding of sum p_topk is magnified by 1 / tail in log(tail), which cost
    # up to ~6e-6 relative error in the reverse-KL gradient in the tests.
    topk_lp_CK = topk_lp_CK.double()
    # Rounding can put the sum a hair above 1; clamp so log1mexp stays defined.
    lse_C = torch.logsumexp(topk_lp_CK, dim=-1).clamp(max=0.0)
    # log(1 - e^x), stable: expm1 near x = 0, log1p(-e^x) for very negative x.
    tail_C = torch.where(lse_C > -math.log(2.0), torch.log(-torch.expm1(lse_C)), torch.log1p(-torch.exp(lse_C)))
    tail_C = tail_C.clamp(min=math.log(TAIL_EPS))
    return torch.cat([topk_lp_CK, tail_C[:, None]], dim=-1).float()


# --------------------------------------------------------------------------- the chunked loop


def _validate(hidden_NH: Tensor, head_VH: Tensor, targets: PositionTargets, spec: LossSpec,
              chunk_size: int, normalizer: float, vocab_limit: int) -> None:
    n = hidden_NH.shape[0]
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    if not 0 < vocab_limit <= head_VH.shape[0]:
        raise ValueError(f"vocab_limit {vocab_limit} must be in [1, {head_VH.shape[0]}] (the head's rows)")
    if targets.token_ids_N.shape != (n,):
        raise ValueError(f"token_ids_N has shape {tuple(targets.token_ids_N.shape)}, expected ({n},)")
    _check_ids(targets.token_ids_N, vocab_limit, "token ids")
    if spec.mode == "sampled_kl":
        if targets.teacher_logprobs_N is None or targets.teacher_logprobs_N.shape != (n,):
            raise ValueError(f"sampled_kl needs teacher_logprobs_N of shape ({n},)")
    elif spec.mode == "topk_tail":
        ids, lps = targets.topk_ids_NK, targets.topk_logprobs_NK
        if ids is None or lps is None or ids.shape != lps.shape or ids.dim() != 2 or ids.shape[0] != n:
            raise ValueError(f"topk_tail needs topk_ids_NK and topk_logprobs_NK of one shape ({n}, K)")
        if not ids.shape[1] < vocab_limit:
            raise ValueError(f"topk_tail needs K < vocab_limit so the tail bucket is not empty; K = {ids.shape[1]}")
        _check_ids(ids, vocab_limit, "top-k ids")
    else:
        th, tw = targets.teacher_hidden_NH, targets.teacher_head_VH
        if th is None or tw is None or th.dim() != 2 or th.shape[0] != n or tw.shape[1] != th.shape[1]:
            raise ValueError(f"exact needs teacher_hidden_NH ({n}, H_t) and teacher_head_VH (V_t, H_t)")
        if tw.shape[0] < vocab_limit:
            raise ValueError(f"teacher head has {tw.shape[0]} rows, fewer than vocab_limit {vocab_limit}")


def _chunk_logits(h_CH: Tensor, w_VH: Tensor) -> Tensor:
    """[C, V] logits for the loss: bf16/fp16 heads multiply in their dtype, then upcast to float32
    (a float32 copy of a bf16 Qwen3 head would be 0.6-1.2 GiB); a float32 head (CPU) gets float64.

    float32 matmuls round differently for different chunk and micro-batch shapes,
    and sampled_kl's (log p_s - log p_t) coefficient turns that into ~1e-6
    relative gradient noise; float64 keeps the objective independent of the cut.
    """
    if w_VH.dtype == torch.float32:
        return h_CH.double() @ w_VH.double().T
    return (h_CH.to(w_VH.dtype) @ w_VH.T).float()


def chunked_loss_backward(hidden_NH: Tensor, head_VH: Tensor, targets: PositionTargets, spec: LossSpec,
                          chunk_size: int, normalizer: float, vocab_limit: int,
                          memory_guard: Callable[[int], None] | None = None, fused: bool | None = None,
                          consume_hidden: bool = False) -> LossStats:
    """Add d[(sum_i loss_i) / normalizer] to the grads upstream of `hidden_NH` (and of `head_VH`).

    Backward runs here, chunk by chunk, so at most one chunk's logits live at
    once. `memory_guard(elements)` is called before each [C, V_real] logits
    tensor is built (student, and teacher for `exact`); whatever it raises
    propagates, with no gradient written upstream.

    `fused`: the Triton path for `exact` (`fused_exact_applies` decides when
    None); False forces the unfused one, True requires the fused one.
    `consume_hidden`: the caller will not read `hidden_NH` again, so the fused
    path frees its storage once the chunks are done, before the model's backward.
    """
    _validate(hidden_NH, head_VH, targets, spec, chunk_size, normalizer, vocab_limit)
    n = hidden_NH.shape[0]
    want_hidden = hidden_NH.requires_grad
    want_head = head_VH.requires_grad
    need_grad = want_hidden or want_head
    if fused is None:
        fused = fused_exact_applies(head_VH, targets, spec)
    if fused:
        return _fused_exact_backward(hidden_NH, head_VH, targets, spec, chunk_size, normalizer, vocab_limit,
                                     memory_guard, consume_hidden)

    # Detached leaves: each chunk's backward stops here instead of re-walking
    # (and freeing) the model graph; the model backward runs once at the end.
    # The heads stay in their own dtype (views, no copies: a float32 copy of a
    # bf16 Qwen3 head is 0.6-1.2 GiB); only each chunk's logits are upcast.
    w_VH = head_VH.detach()[:vocab_limit].requires_grad_(want_head)
    grad_h_NH = torch.zeros_like(hidden_NH) if want_hidden else None
    grad_w_VH = torch.zeros_like(w_VH, dtype=torch.float32) if want_head else None  # sums over all chunks

    teacher_w_VH = None
    if spec.mode == "exact":
        teacher_w_VH = targets.teacher_head_VH.detach()[:vocab_limit]

    loss_total = torch.zeros((), dtype=torch.float64, device=hidden_NH.device)
    kl_total = torch.zeros((), dtype=torch.float64, device=hidden_NH.device)
    chunks = 0
    for lo in range(0, n, chunk_size):
        hi = min(lo + chunk_size, n)
        c = hi - lo
        chunks += 1
        # Per-chunk leaf (rather than indexing one [N, H] leaf) so each backward
        # writes only its own [C, H] rows: no O(N^2 / C) zero-filled grads.
        h_CH = hidden_NH.detach()[lo:hi].requires_grad_(want_hidden)
        tokens_C = targets.token_ids_N[lo:hi].long()

        teacher_logp_CV = None
        if spec.mode == "exact":
            with torch.no_grad():
                if memory_guard is not None:
                    memory_guard(c * vocab_limit)
                teacher_logits_CV = _chunk_logits(targets.teacher_hidden_NH[lo:hi].to(teacher_w_VH.device),
                                                  teacher_w_VH)
                teacher_logp_CV = torch.log_softmax(teacher_logits_CV, dim=-1)
                del teacher_logits_CV

        with torch.enable_grad() if need_grad else torch.no_grad():
            if memory_guard is not None:
                memory_guard(c * vocab_limit)
            logits_CV = _chunk_logits(h_CH, w_VH)
            if spec.mode == "sampled_kl":
                teacher_lp_C = targets.teacher_logprobs_N[lo:hi].to(logits_CV.dtype)
                loss_C, kl_C = _sampled_kl(logits_CV, tokens_C, teacher_lp_C)
            elif spec.mode == "topk_tail":
                ids_CK = targets.topk_ids_NK[lo:hi].long()
                logp_s_CB = _student_buckets(logits_CV, ids_CK)
                logp_t_CB = _teacher_buckets(targets.topk_logprobs_NK[lo:hi])
                loss_C = divergence(spec, logp_s_CB, logp_t_CB)
                kl_C = loss_C.detach()
            else:
                logp_s_CV = torch.log_softmax(logits_CV, dim=-1)
                loss_C = divergence(spec, logp_s_CV, teacher_logp_CV)
                kl_C = loss_C.detach()
            chunk_loss = loss_C.sum()

        if need_grad:
            inputs = [t for t, want in ((h_CH, want_hidden), (w_VH, want_head)) if want]
            grads = torch.autograd.grad(chunk_loss / normalizer, inputs)
            if want_hidden:
                grad_h_NH[lo:hi] = grads[0]
            if want_head:
                grad_w_VH += grads[-1]
        loss_total += chunk_loss.detach().double()
        kl_total += kl_C.sum().double()
        del logits_CV, loss_C, chunk_loss, teacher_logp_CV

    # One backward through the model for all chunks together. Only the real
    # rows of the head get a gradient; padded rows get zeros.
    outputs, out_grads = [], []
    if want_hidden and n > 0:
        outputs.append(hidden_NH)
        out_grads.append(grad_h_NH)
    if want_head and n > 0:
        with torch.enable_grad():  # the slice must join the graph even if the caller disabled grad
            outputs.append(head_VH[:vocab_limit])
        out_grads.append(grad_w_VH.to(head_VH.dtype))
    if outputs:
        torch.autograd.backward(outputs, out_grads)

    return LossStats(loss_sum=float(loss_total), kl_sum=float(kl_total), positions=n, chunks=chunks)


# --------------------------------------------------------------------------- the fused exact path


def fused_exact_applies(head_VH: Tensor, targets: PositionTargets, spec: LossSpec) -> bool:
    """`exact` on a CUDA half-precision head that is not trained, with Triton importable."""
    if spec.mode != "exact" or head_VH.requires_grad or not head_VH.is_cuda:
        return False
    teacher_VH = targets.teacher_head_VH
    if head_VH.dtype not in (torch.bfloat16, torch.float16) or teacher_VH is None or teacher_VH.dtype != head_VH.dtype:
        return False
    try:
        import triton  # noqa: F401 - CUDA builds of PyTorch ship it; a CPU build need not
    except ImportError:
        return False
    return True


def _fused_exact_backward(hidden_NH: Tensor, head_VH: Tensor, targets: PositionTargets, spec: LossSpec,
                          chunk_size: int, normalizer: float, vocab_limit: int,
                          memory_guard: Callable[[int], None] | None, consume_hidden: bool = False) -> LossStats:
    """`exact` with `fused_exact.divergence_and_grad`: per chunk two GEMMs in, one GEMM out, no float32 [C, V]."""
    from miniverl.engine.distill.fused_exact import divergence_and_grad

    n = hidden_NH.shape[0]
    want_hidden = hidden_NH.requires_grad
    # The whole padded heads: aligned rows for the GEMMs; the kernel reads only columns < vocab_limit.
    w_VH, teacher_w_VH = head_VH.detach(), targets.teacher_head_VH.detach()
    grad_h_NH = torch.zeros_like(hidden_NH) if want_hidden else None
    loss_total = torch.zeros((), dtype=torch.float64, device=hidden_NH.device)
    chunks = 0
    with torch.no_grad():
        for lo in range(0, n, chunk_size):
            hi = min(lo + chunk_size, n)
            chunks += 1
            if memory_guard is not None:
                memory_guard((hi - lo) * vocab_limit)
            # The teacher's hidden states may wait in host memory (stages.gradient): one chunk comes over.
            teacher_CV = targets.teacher_hidden_NH[lo:hi].to(teacher_w_VH.device, teacher_w_VH.dtype) @ teacher_w_VH.T
            if memory_guard is not None:
                memory_guard((hi - lo) * vocab_limit)
            student_CV = hidden_NH.detach()[lo:hi].to(w_VH.dtype) @ w_VH.T
            value_C = divergence_and_grad(student_CV, teacher_CV, vocab_limit, spec.divergence, spec.jsd_beta,
                                          1.0 / normalizer)
            del teacher_CV
            if want_hidden:
                grad_h_NH[lo:hi] = (student_CV @ w_VH).to(grad_h_NH.dtype)  # student_CV now holds dLoss/dS
            del student_CV
            loss_total += value_C.double().sum()
    if want_hidden and n > 0:
        # The model's backward from sum(h * g), whose gradient in h is g exactly: the product's node
        # then holds the only reference to g and drops it once it has run, where a backward from h
        # with g as its gradient would keep g alive through the whole model (6 MB at 6 x 704 tokens).
        surrogate = (hidden_NH * grad_h_NH).sum()
        del grad_h_NH
        if consume_hidden and not hidden_NH.is_leaf and hidden_NH._base is None:
            hidden_NH.untyped_storage().resize_(0)  # its values are read; only its graph is needed now
        surrogate.backward()
    total = float(loss_total)
    return LossStats(loss_sum=total, kl_sum=total, positions=n, chunks=chunks)
