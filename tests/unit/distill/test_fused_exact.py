"""The fused `exact` loss (engine/distill/fused_exact.py) against float64 references written from the definitions.

On a CUDA machine these run the Triton kernels on the GPU; without CUDA they run
the same kernels under Triton's interpreter (TRITON_INTERPRET=1, which
tests/conftest.py sets before any kernel is defined), so CI checks them on every commit. Skipped only where
Triton is not installed (it comes with the `dev` extra and with CUDA builds of
PyTorch).

The reference takes the very bf16 logits the kernels read, in float64: the
value must agree to float32 rounding, the gradient (rounded to bf16 like the
logits' own gradient in the unfused path) to bf16 rounding. Vocabularies are
longer than a kernel block and padded (the teacher's head by a different
number of rows) so the masks and the padded-row rule are exercised.
"""

from __future__ import annotations

import math

import pytest
import torch

from miniverl.engine.distill.losses import LossSpec, PositionTargets, chunked_loss_backward

pytest.importorskip("triton", reason="needs Triton (the dev extra installs it)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

N, H, H_T = 37, 32, 48
V, V_PAD, V_PAD_T = 9001, 9216, 9088  # 3 blocks of 4096; padded rows differ between the heads
NORMALIZER = 50.0
SPECS = [LossSpec("exact", "reverse_kl"), LossSpec("exact", "forward_kl"), LossSpec("exact", "jsd", 0.3)]
IDS = [s.divergence for s in SPECS]


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def problem(seed: int, near: float | None = None, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    head = torch.randn(V_PAD, H, generator=g) * (3.0 / math.sqrt(H))
    t_hidden = torch.randn(N, H_T, generator=g)
    t_head = torch.randn(V_PAD_T, H_T, generator=g) * (3.0 / math.sqrt(H_T))
    if near is not None:  # the teacher is the student plus noise: small divergences, small gradients
        t_hidden = torch.cat([hidden, torch.zeros(N, H_T - H)], dim=1) + near * torch.randn(N, H_T, generator=g)
        t_head = torch.cat([torch.cat([head, torch.zeros(V_PAD, H_T - H)], dim=1)[:V_PAD_T]], dim=0)
        t_head = t_head + near * torch.randn(V_PAD_T, H_T, generator=g)
    head[V:] = 100.0  # padded rows with logits that would dominate any softmax they took part in
    t_head[V:] = -100.0
    to = dict(device=DEVICE, dtype=dtype)
    return dict(hidden=hidden.to(**to), head=head.to(**to), t_hidden=t_hidden.to(**to), t_head=t_head.to(**to))


def reference_divergence(spec: LossSpec, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Per-row divergence over the real columns, float64, from the definitions."""
    ps, pt = torch.softmax(s[:, :V], dim=-1), torch.softmax(t[:, :V], dim=-1)

    def kl(p, q):
        return (p * (p.log() - q.log())).sum(-1)

    if spec.divergence == "reverse_kl":
        return kl(ps, pt)
    if spec.divergence == "forward_kl":
        return kl(pt, ps)
    m = spec.jsd_beta * pt + (1 - spec.jsd_beta) * ps
    return spec.jsd_beta * kl(pt, m) + (1 - spec.jsd_beta) * kl(ps, m)


@pytest.mark.parametrize("near", [None, 0.05], ids=["far", "near"])
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_kernel_matches_float64_on_the_same_logits(spec: LossSpec, near):
    from miniverl.engine.distill.fused_exact import divergence_and_grad

    p = problem(0, near)
    s = p["hidden"] @ p["head"].T
    t = p["t_hidden"] @ p["t_head"].T
    s64 = s.double().requires_grad_(True)
    want = reference_divergence(spec, s64, t.double())
    (want.sum() / NORMALIZER).backward()
    got = divergence_and_grad(s, t, V, spec.divergence, spec.jsd_beta, 1.0 / NORMALIZER)
    assert got.dtype == torch.float32 and got.shape == (N,)
    assert rel(got, want.detach()) <= 2e-5
    assert rel(s[:, :V], s64.grad[:, :V]) <= 8e-3  # s now holds the gradient, rounded to bf16
    assert torch.count_nonzero(s[:, V:]) == 0  # padded columns: no gradient, whatever their logits were
    assert float(s64.grad[:, V:].abs().max()) == 0.0


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_chunked_loss_fused_equals_unfused_and_float64(spec: LossSpec):
    """The whole chunked loss: the hidden states' gradient and the value, at chunks that do not divide N."""
    p = problem(1)
    targets = PositionTargets(torch.zeros(N, dtype=torch.long, device=DEVICE), teacher_hidden_NH=p["t_hidden"],
                              teacher_head_VH=p["t_head"])
    results = {}
    for fused, chunk in ((True, 5), (True, N), (False, 7)):
        hidden = p["hidden"].clone().requires_grad_(True)
        stats = chunked_loss_backward(hidden, p["head"], targets, spec, chunk, NORMALIZER, V, fused=fused)
        assert stats.positions == N and stats.chunks == math.ceil(N / chunk)
        results[fused, chunk] = (stats.loss_sum, hidden.grad.clone())
    h64 = p["hidden"].double().requires_grad_(True)
    want = reference_divergence(spec, h64 @ p["head"].double().T, p["t_hidden"].double() @ p["t_head"].double().T)
    (want.sum() / NORMALIZER).backward()
    for (fused, chunk), (loss_sum, grad) in results.items():
        # Against float64 on unrounded logits: the bf16 rounding of the logits shows (~1e-3).
        assert abs(loss_sum - float(want.detach().sum())) <= 1e-2 * abs(float(want.detach().sum())), (fused, chunk)
        assert rel(grad, h64.grad) <= 3e-2, (fused, chunk)
    fused_loss, fused_grad = results[True, 5]
    plain_loss, plain_grad = results[False, 7]
    assert abs(fused_loss - plain_loss) <= 1e-5 * abs(plain_loss)  # the same bf16 logits, float32 arithmetic
    assert rel(fused_grad, plain_grad) <= 1e-2
    assert rel(results[True, N][1], fused_grad) <= 1e-2


def test_float16_logits_and_a_memory_guard():
    spec = SPECS[0]
    p = problem(2, dtype=torch.float16)
    targets = PositionTargets(torch.zeros(N, dtype=torch.long, device=DEVICE), teacher_hidden_NH=p["t_hidden"],
                              teacher_head_VH=p["t_head"])
    seen = []
    hidden = p["hidden"].clone().requires_grad_(True)
    stats = chunked_loss_backward(hidden, p["head"], targets, spec, 16, NORMALIZER, V, seen.append, fused=True)
    assert seen == [16 * V] * 4 + [5 * V] * 2  # before the teacher's and the student's logits of each chunk
    want = reference_divergence(spec, p["hidden"].double() @ p["head"].double().T,
                                p["t_hidden"].double() @ p["t_head"].double().T)
    assert abs(stats.loss_sum - float(want.detach().sum())) <= 1e-2 * float(want.sum())
    assert hidden.grad.dtype == torch.float16 and torch.isfinite(hidden.grad).all()


def test_consumed_hidden_states_are_freed_and_the_gradient_is_unchanged():
    """consume_hidden (the gradient stage's call): the gathered hidden states' storage goes before the model's
    backward, and the gradient reaching the model is the same as when they are kept; the teacher's hidden
    states may wait on the host (stages.gradient keeps them there)."""
    spec = SPECS[0]
    p = problem(3)
    targets = PositionTargets(torch.zeros(N, dtype=torch.long, device=DEVICE), teacher_hidden_NH=p["t_hidden"].cpu(),
                              teacher_head_VH=p["t_head"])
    grads = {}
    for consume in (False, True):
        leaf = p["hidden"].clone().requires_grad_(True)
        hidden = leaf * 1.0  # a non-leaf, as the model's output is
        chunked_loss_backward(hidden, p["head"], targets, spec, 7, NORMALIZER, V, fused=True, consume_hidden=consume)
        assert (hidden.untyped_storage().size() == 0) == consume
        grads[consume] = leaf.grad.clone()
    assert torch.equal(grads[True], grads[False]) and grads[True].abs().sum() > 0
