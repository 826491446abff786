"""The gradient stage's lean LoRA branch is peft's arithmetic with a smaller backward.

Against a float64 reference on the same inputs (a real peft LoRA layer over a
frozen linear), then the whole gradient stage with and without it: the same
gradient to float32 rounding, every adapted projection patched inside the
block and peft's forward back after it.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from miniverl.engine.models import lora_branch


class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(12, 20, bias=False)
        self.down_proj = torch.nn.Linear(20, 12, bias=False)

    def forward(self, x):
        return self.down_proj(torch.tanh(self.q_proj(x)))


def _model(dropout: float = 0.0):
    torch.manual_seed(0)
    model = get_peft_model(_Two(), LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                              target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model


def _grads(model, x):
    for p in model.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    (model(x) ** 2).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, x.grad


@pytest.mark.parametrize("slice_bytes", [lora_branch.SLICE_BYTES, 4 * 20 * 4])  # one slice; slices of 4 rows
def test_matches_peft_and_a_float64_reference(monkeypatch, slice_bytes):
    monkeypatch.setattr(lora_branch, "SLICE_BYTES", slice_bytes)
    assert len(lora_branch._slices(15, 20)) == (1 if slice_bytes > 15 * 20 * 4 else 4)
    model = _model()
    x = torch.randn(3, 5, 12)
    want, want_x = _grads(model.double(), x.double())
    model = model.float()
    got_peft, _ = _grads(model, x)
    with lora_branch.lean_lora(model) as patched:
        assert patched == 2
        out_lean = model(x)
        got, got_x = _grads(model, x)
    assert "forward" not in vars(model.base_model.model.q_proj)  # peft's forward is back
    assert torch.allclose(out_lean, model(x), rtol=1e-6, atol=1e-6)
    assert set(got) == set(want) == set(got_peft) and len(got) == 4
    for name in want:
        scale = want[name].norm()
        assert scale > 0
        assert float((got[name].double() - want[name]).norm() / scale) < 1e-5, name
        assert float((got_peft[name].double() - want[name]).norm() / scale) < 1e-5, name
    assert float((got_x.double() - want_x).norm() / want_x.norm()) < 1e-5


def test_bfloat16_model_float32_adapter_like_the_gpu_path():
    """A bf16 base with a float32 adapter: the branch computes in float32 and returns bf16, as peft does."""
    model = _model().to(torch.bfloat16)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    x = torch.randn(2, 7, 12, dtype=torch.bfloat16)
    peft_out = model(x)
    got_peft, _ = _grads(model, x)
    with lora_branch.lean_lora(model):
        lean_out = model(x)
        got, _ = _grads(model, x)
    assert lean_out.dtype == torch.bfloat16 and torch.equal(lean_out, peft_out)
    for name in got_peft:
        assert got[name].dtype == torch.float32
        assert float((got[name] - got_peft[name]).norm() / got_peft[name].norm()) < 1e-2, name


@pytest.mark.parametrize("dropout", [0.1])
def test_dropout_keeps_peft_forward(dropout):
    model = _model(dropout)
    with lora_branch.lean_lora(model) as patched:
        assert patched == 0


def test_the_rounded_branch_in_slices_matches_one_pass(monkeypatch):
    """The branch a bitsandbytes layer rounds before its sum, computed a slice of rows at a time,
    against the one-pass float32 product; and its backward against float64."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 16, generator=gen).to(torch.bfloat16).requires_grad_(True)
    a = (torch.randn(4, 16, generator=gen) * 0.3).requires_grad_(True)
    b = (torch.randn(24, 4, generator=gen) * 0.3).requires_grad_(True)
    want = (torch.nn.functional.linear(torch.nn.functional.linear(x.float(), a), b) * 2.0).to(torch.bfloat16)
    monkeypatch.setattr(lora_branch, "SLICE_BYTES", 2 * 24 * 4)  # slices of two rows
    assert len(lora_branch._slices(9, 24)) == 5
    got = lora_branch._LoraBranch.apply(x, a, b, 2.0, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.allclose(got.float(), want.float(), rtol=8e-3, atol=1e-6)
    weights = torch.randn(9, 24, generator=gen)
    (got.float() * weights).sum().backward()
    x64, a64, b64 = (t.detach().double().requires_grad_(True) for t in (x, a, b))
    ((x64 @ a64.T @ b64.T * 2.0) * weights.double()).sum().backward()
    for mine, ref in ((a.grad, a64.grad), (b.grad, b64.grad), (x.grad, x64.grad)):
        assert float((mine.double() - ref).norm() / ref.norm()) < 1e-2
