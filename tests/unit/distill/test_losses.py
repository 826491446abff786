"""Chunked distillation losses against naive float64 references written from the definitions.

The reference builds the full [N, V] logits in float64 and loops over positions
with plain softmax formulas; the engine works in float32, chunk by chunk, with
its own backward. Values and gradients (w.r.t. an upstream weight, the hidden
states and the student head) must agree to 1e-5 relative error.
"""

from __future__ import annotations

import math

import pytest
import torch

from miniverl.engine.distill.losses import (
    TAIL_EPS,
    LossSpec,
    PositionTargets,
    chunked_loss_backward,
    teacher_topk,
    token_logprobs,
)

N, D_IN, H, H_T, V_PAD, V, K = 37, 12, 16, 24, 53, 47, 5
NORMALIZER = 50.0  # deliberately not N: the objective must be divided by exactly this
CHUNKS = [1, 3, 7, N, 2 * N]
CONFIGS = [
    LossSpec("sampled_kl"),
    LossSpec("topk_tail", "reverse_kl"),
    LossSpec("topk_tail", "forward_kl"),
    LossSpec("topk_tail", "jsd", 0.3),  # beta != 0.5 so a beta / (1 - beta) swap shows
    LossSpec("exact", "reverse_kl"),
    LossSpec("exact", "forward_kl"),
    LossSpec("exact", "jsd", 0.3),
]
IDS = [f"{s.mode}-{s.divergence}" if s.mode != "sampled_kl" else s.mode for s in CONFIGS]


def rel_err(got: torch.Tensor | float, want: torch.Tensor | float) -> float:
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    return float((got - want).norm() / want.norm())


def make_problem(seed: int = 0, near: float | None = None) -> dict[str, torch.Tensor]:
    """float32 inputs: upstream x, W (hidden = x @ W), padded heads, teacher hidden, and targets.

    `near`: the teacher is the student plus noise of this scale, so the two nearly agree.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D_IN, generator=g)
    w_up = torch.randn(D_IN, H, generator=g) / math.sqrt(D_IN)
    head = torch.randn(V_PAD, H, generator=g) * 0.6
    t_hidden = torch.randn(N, H_T, generator=g)
    t_head = torch.randn(V_PAD, H_T, generator=g) * 0.5
    if near is not None:
        with torch.no_grad():
            t_hidden = x @ w_up + near * torch.randn(N, H, generator=g)
            t_head = head + near * torch.randn(V_PAD, H, generator=g)
    with torch.no_grad():
        s_logits64 = (x.double() @ w_up.double()) @ head[:V].double().T
        t_logp64 = torch.log_softmax(t_hidden.double() @ t_head[:V].double().T, dim=-1)
    # On-policy: tokens are samples from the student.
    tokens = torch.multinomial(torch.softmax(s_logits64, -1), 1, generator=g).squeeze(-1)
    topk_lp, topk_ids = t_logp64.sort(dim=-1, descending=True)
    return dict(
        x=x, w_up=w_up, head=head, t_hidden=t_hidden, t_head=t_head, tokens=tokens,
        teacher_lp=t_logp64.gather(-1, tokens[:, None]).squeeze(-1).float(),
        topk_ids=topk_ids[:, :K].contiguous(), topk_lp=topk_lp[:, :K].float().contiguous(),
    )


def targets_for(p: dict[str, torch.Tensor]) -> PositionTargets:
    return PositionTargets(p["tokens"], teacher_logprobs_N=p["teacher_lp"], topk_ids_NK=p["topk_ids"],
                           topk_logprobs_NK=p["topk_lp"], teacher_hidden_NH=p["t_hidden"], teacher_head_VH=p["t_head"])


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These tensors are tiny: thread start-up dominates (10-100x slower on a
    # small box) and one thread keeps the float32 results reproducible.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- float64 reference


def _ref_divergence(spec: LossSpec, ps: torch.Tensor, pt: torch.Tensor) -> torch.Tensor:
    def kl(p, q):
        return (p * torch.log(p / q)).sum()

    if spec.divergence == "reverse_kl":
        return kl(ps, pt)
    if spec.divergence == "forward_kl":
        return kl(pt, ps)
    b = spec.jsd_beta
    m = b * pt + (1 - b) * ps
    return b * kl(pt, m) + (1 - b) * kl(ps, m)


def reference(spec: LossSpec, p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | float]:
    x = p["x"].double()
    w_up = p["w_up"].double().requires_grad_(True)
    head = p["head"].double().requires_grad_(True)
    hidden = x @ w_up
    hidden.retain_grad()
    logits = hidden @ head[:V].T  # the full [N, V] logits, real vocab only
    t_logits = p["t_hidden"].double() @ p["t_head"][:V].double().T
    losses, kls = [], []
    for i in range(N):
        ps = torch.softmax(logits[i], dim=0)
        if spec.mode == "sampled_kl":
            tok = int(p["tokens"][i])
            lps = torch.log(ps[tok])
            t = p["teacher_lp"][i].double()
            advantage = -(lps.detach() - t)
            losses.append(-advantage * lps)
            kls.append(lps.detach() - t)
        elif spec.mode == "topk_tail":
            ids = p["topk_ids"][i]
            pt_top = torch.exp(p["topk_lp"][i].double())
            pt = torch.cat([pt_top, torch.clamp(1 - pt_top.sum(), min=TAIL_EPS)[None]])
            ps_top = ps[ids]
            ps_b = torch.cat([ps_top, (1 - ps_top.sum())[None]])
            loss = _ref_divergence(spec, ps_b, pt)
            losses.append(loss)
            kls.append(loss.detach())
        else:
            pt = torch.softmax(t_logits[i], dim=0)
            loss = _ref_divergence(spec, ps, pt)
            losses.append(loss)
            kls.append(loss.detach())
    total = torch.stack(losses).sum() / NORMALIZER
    total.backward()
    return dict(value=float(total.detach()), kl_sum=float(torch.stack(kls).sum()),
                grad_w=w_up.grad, grad_head=head.grad, grad_hidden=hidden.grad)


_REF_CACHE: dict[LossSpec, dict] = {}


def cached_reference(spec: LossSpec) -> dict:
    if spec not in _REF_CACHE:
        _REF_CACHE[spec] = reference(spec, make_problem())
    return _REF_CACHE[spec]


# ----------------------------------------------------------------------------- engine runner


def run_engine(spec: LossSpec, p: dict[str, torch.Tensor], chunk: int, head_grad: bool = True,
               guard=None, hidden_dtype: torch.dtype = torch.float32):
    w_up = p["w_up"].clone().requires_grad_(True)
    head = p["head"].clone().requires_grad_(head_grad)
    hidden = (p["x"] @ w_up).to(hidden_dtype)
    hidden.retain_grad()
    stats = chunked_loss_backward(hidden, head, targets_for(p), spec, chunk, NORMALIZER, V, guard)
    return stats, w_up, head, hidden


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("spec", CONFIGS[1:], ids=IDS[1:])
def test_matches_reference_when_teacher_nearly_agrees(spec: LossSpec):
    """Small divergences have small gradients, so float32 cancellation shows here first.

    (Closer still, the float32 rounding of the logits themselves, ~1e-7, dominates
    any formulation: relative error grows like 1e-7 / |log p_s - log p_t|.)
    """
    p = make_problem(seed=3, near=0.05)
    ref = reference(spec, p)
    stats, w_up, head, hidden = run_engine(spec, p, 7)
    assert rel_err(stats.loss_sum / NORMALIZER, ref["value"]) <= 1e-5
    assert rel_err(hidden.grad, ref["grad_hidden"]) <= 1e-5
    assert rel_err(w_up.grad, ref["grad_w"]) <= 1e-5
    assert rel_err(head.grad, ref["grad_head"]) <= 1e-5


def test_reference_distinguishes_configs():
    """Guards the tests themselves: a swapped mode, divergence or beta would not go unnoticed."""
    values = [cached_reference(s)["value"] for s in CONFIGS]
    for i in range(len(values)):
        for j in range(i + 1, len(values)):
            assert abs(values[i] - values[j]) > 1e-3 * abs(values[j]), (IDS[i], IDS[j])
    jsd_half = reference(LossSpec("exact", "jsd", 0.5), make_problem())["value"]
    jsd_swapped = reference(LossSpec("exact", "jsd", 0.7), make_problem())["value"]
    assert abs(jsd_half - cached_reference(CONFIGS[-1])["value"]) > 1e-4
    assert abs(jsd_swapped - cached_reference(CONFIGS[-1])["value"]) > 1e-4


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("spec", CONFIGS, ids=IDS)
def test_matches_float64_reference(spec: LossSpec, chunk: int):
    ref = cached_reference(spec)
    stats, w_up, head, hidden = run_engine(spec, make_problem(), chunk)
    assert stats.positions == N
    assert stats.chunks == math.ceil(N / chunk)
    assert rel_err(stats.loss_sum / NORMALIZER, ref["value"]) <= 1e-5
    assert rel_err(stats.kl_sum, ref["kl_sum"]) <= 1e-5
    assert rel_err(hidden.grad, ref["grad_hidden"]) <= 1e-5
    assert rel_err(w_up.grad, ref["grad_w"]) <= 1e-5  # upstream parameter, through hidden = x @ W
    assert rel_err(head.grad, ref["grad_head"]) <= 1e-5
    assert torch.all(head.grad[V:] == 0)  # padded rows never take part


@pytest.mark.parametrize("spec", [CONFIGS[0], CONFIGS[1], CONFIGS[4]], ids=[IDS[0], IDS[1], IDS[4]])
def test_frozen_head_still_trains_upstream(spec: LossSpec):
    ref = cached_reference(spec)
    stats, w_up, head, _ = run_engine(spec, make_problem(), 5, head_grad=False)
    assert head.grad is None
    assert rel_err(w_up.grad, ref["grad_w"]) <= 1e-5
    assert rel_err(stats.loss_sum / NORMALIZER, ref["value"]) <= 1e-5


@pytest.mark.parametrize("spec", CONFIGS, ids=IDS)
def test_chunk_size_invariance(spec: LossSpec):
    p = make_problem(seed=4)
    s1, w1, h1, x1 = run_engine(spec, p, 1)
    sn, wn, hn, xn = run_engine(spec, p, N)
    assert rel_err(s1.loss_sum, sn.loss_sum) <= 1e-6
    assert rel_err(x1.grad, xn.grad) <= 1e-6
    assert rel_err(w1.grad, wn.grad) <= 1e-6
    assert rel_err(h1.grad, hn.grad) <= 1e-6


@pytest.mark.parametrize("spec", CONFIGS, ids=IDS)
def test_padded_rows_are_excluded(spec: LossSpec):
    p = make_problem(seed=2)
    base, w0, h0, _ = run_engine(spec, p, 7)
    huge = dict(p)
    huge["head"], huge["t_head"] = p["head"].clone(), p["t_head"].clone()
    huge["head"][V:] = 1e4  # would own every softmax if padded rows leaked in
    huge["t_head"][V:] = 1e4
    got, w1, h1, _ = run_engine(spec, huge, 7)
    assert got.loss_sum == base.loss_sum and got.kl_sum == base.kl_sum
    assert torch.equal(w1.grad, w0.grad)
    assert torch.equal(h1.grad, h0.grad)


@pytest.mark.parametrize("spec", [CONFIGS[0], CONFIGS[2], CONFIGS[5]], ids=[IDS[0], IDS[2], IDS[5]])
def test_memory_guard_sees_each_chunks_logits(spec: LossSpec):
    seen: list[int] = []
    run_engine(spec, make_problem(), 7, guard=seen.append)
    per_chunk = [7 * V] * (N // 7) + [(N % 7) * V]
    # exact also builds the teacher's [C, V] logits per chunk, each guarded.
    want = [s for s in per_chunk for _ in range(2 if spec.mode == "exact" else 1)]
    assert seen == want


def test_memory_guard_error_propagates_and_writes_no_gradient():
    calls: list[int] = []

    def guard(elements: int) -> None:
        calls.append(elements)
        if len(calls) == 3:  # fail mid-way, after two chunks have done their backward
            raise torch.OutOfMemoryError(f"injected at {elements}")

    p = make_problem()
    w_up = p["w_up"].clone().requires_grad_(True)
    head = p["head"].clone().requires_grad_(True)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        chunked_loss_backward(p["x"] @ w_up, head, targets_for(p), CONFIGS[1], 7, NORMALIZER, V, guard)
    assert calls == [7 * V] * 3
    # Nothing half-done reaches the parameters: the OOM retry starts from clean grads.
    assert w_up.grad is None and head.grad is None


def test_bfloat16_hidden_runs_and_roughly_matches():
    spec = CONFIGS[4]
    ref = cached_reference(spec)
    stats, w_up, _, hidden = run_engine(spec, make_problem(), 7, hidden_dtype=torch.bfloat16)
    assert hidden.grad.dtype == torch.bfloat16
    assert rel_err(stats.loss_sum / NORMALIZER, ref["value"]) <= 3e-2
    assert rel_err(w_up.grad, ref["grad_w"]) <= 3e-2


def test_no_grad_inputs_give_value_only():
    p = make_problem()
    stats = chunked_loss_backward(p["x"] @ p["w_up"], p["head"], targets_for(p), CONFIGS[4], 7, NORMALIZER, V)
    assert rel_err(stats.loss_sum / NORMALIZER, cached_reference(CONFIGS[4])["value"]) <= 1e-5


def test_rejects_bad_inputs():
    p = make_problem()
    hidden = p["x"] @ p["w_up"]
    bad = targets_for(p)
    bad.token_ids_N = p["tokens"].clone()
    bad.token_ids_N[3] = V  # a padded id
    with pytest.raises(ValueError, match="token ids"):
        chunked_loss_backward(hidden, p["head"], bad, CONFIGS[0], 7, NORMALIZER, V)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_loss_backward(hidden, p["head"], targets_for(p), CONFIGS[0], 0, NORMALIZER, V)
    with pytest.raises(ValueError, match="jsd_beta"):
        LossSpec("exact", "jsd", 1.0)


def test_topk_tail_survives_a_tail_that_rounds_to_zero():
    """A teacher whose top-k sum rounds to >= 1: the clamped tail keeps everything finite."""
    p = make_problem()
    p["topk_lp"] = torch.full((N, K), math.log(1.0 / K) + 1e-7)  # sums to a hair above 1
    for div in ("reverse_kl", "forward_kl", "jsd"):
        stats, w_up, head, _ = run_engine(LossSpec("topk_tail", div), p, 7)
        assert math.isfinite(stats.loss_sum)
        assert torch.isfinite(w_up.grad).all() and torch.isfinite(head.grad).all()


def test_teacher_helpers_match_float64():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(11, V_PAD, generator=g) * 3
    logits[:, V:] = 1e4  # padded columns must not enter the softmax
    ref_logp = torch.log_softmax(logits[:, :V].double(), dim=-1)

    tokens = torch.randint(0, V, (11,), generator=g)
    got = token_logprobs(logits, tokens, V)
    want = torch.stack([ref_logp[i, int(tokens[i])] for i in range(11)])
    assert got.dtype == torch.float32
    assert rel_err(got, want) <= 1e-5

    ids, lps = teacher_topk(logits, K, V)
    want_lp, want_ids = ref_logp.sort(dim=-1, descending=True)
    assert torch.equal(ids, want_ids[:, :K])
    assert rel_err(lps, want_lp[:, :K]) <= 1e-5
    assert int(ids.max()) < V

    with pytest.raises(ValueError):
        token_logprobs(logits, torch.full((11,), V), V)
