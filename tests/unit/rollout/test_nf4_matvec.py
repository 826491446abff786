"""nf4_matvec against float64 references on bitsandbytes' own NF4 tensors (CPU: Triton's interpreter; CUDA: the GPU).

The weights are quantized by bitsandbytes itself, single and double
quantized. The float64 reference decodes the packed bytes from the layout's
definition, and that decoding is first checked against bitsandbytes'
`dequantize_4bit`, so the kernel is held to bitsandbytes' format, not to a
reading of it that only the kernel shares; like bitsandbytes' matmul, it then
uses the weights rounded to bf16.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="needs Triton (the dev extra installs it)")
bnb_functional = pytest.importorskip("bitsandbytes.functional")
from miniverl.engine.rollout.nf4_matvec import nf4_matvec  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def quantized(n: int, k: int, nested: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    return bnb_functional.quantize_4bit(weight, blocksize=64, compress_statistics=nested, quant_type="nf4",
                                        quant_storage=torch.uint8)


def decoded64(packed: torch.Tensor, state) -> torch.Tensor:
    """The weight in float64, from the layout: high nibble first, one absmax per 64, nested absmax if any."""
    data = packed.view(-1).cpu().long()
    nibbles = torch.stack([data >> 4, data & 15], dim=1).view(-1)
    if state.nested:
        level2 = state.state2.absmax.cpu().double().repeat_interleave(256)[: state.absmax.numel()]
        absmax = state.state2.code.cpu().double()[state.absmax.cpu().long()] * level2 + float(state.offset)
    else:
        absmax = state.absmax.cpu().double()
    return (state.code.cpu().double()[nibbles] * absmax.repeat_interleave(64)).view(*state.shape)


def as_used(weight64: torch.Tensor) -> torch.Tensor:
    """The weight as bitsandbytes' matmul uses it: dequantized, rounded to the compute dtype (bf16)."""
    return weight64.to(torch.bfloat16).double()


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double().cpu() - want).norm() / want.norm())


@pytest.mark.parametrize("nested", [True, False], ids=["double-quantized", "single"])
def test_the_reference_decoding_is_bitsandbytes_own(nested: bool):
    packed, state = quantized(96, 256, nested)
    ours = decoded64(packed, state)
    theirs = bnb_functional.dequantize_4bit(packed, state).double().cpu()  # rounded to bf16
    assert float((ours - theirs).abs().max()) <= float(theirs.abs().max()) * 2**-8


@pytest.mark.parametrize("nested", [True, False], ids=["double-quantized", "single"])
@pytest.mark.parametrize("n,k,batch", [(96, 256, 1), (70, 384, 5), (33, 192, 17)])  # ragged N, K tail, two batch tiles
def test_matches_float64(nested: bool, n: int, k: int, batch: int):
    packed, state = quantized(n, k, nested, seed=n + k)
    gen = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    y = nf4_matvec(x, packed, state)
    assert y.shape == (batch, n) and y.dtype == torch.bfloat16
    want = x.double().cpu() @ as_used(decoded64(packed, state)).T
    assert rel(y, want) <= 4e-3  # the output's bf16 rounding; the arithmetic is float32


def test_refuses_what_it_cannot_read():
    packed, state = quantized(64, 128, True)
    with pytest.raises(ValueError, match=r"x must be bf16 or fp16 \[B, 128\]"):
        nf4_matvec(torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE), packed, state)
    with pytest.raises(ValueError, match="packed must hold 4096 uint8 bytes"):
        nf4_matvec(torch.zeros(2, 128, dtype=torch.bfloat16, device=DEVICE), packed[:100], state)


def test_norm_lora_and_residual_fused_match_float64():
    """RMSNorm before, LoRA beside, residual after: one kernel against the float64 chain of the three."""
    n, k, batch, rank, scale, eps = 80, 320, 3, 8, 2.0, 1e-6
    packed, state = quantized(n, k, True, seed=7)
    gen = torch.Generator().manual_seed(11)

    def draw(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=gen)).to(torch.bfloat16).to(DEVICE)

    x, norm, residual = draw(batch, k, s=3.0), draw(k, s=0.5), draw(batch, n, s=3.0)
    a, b = draw(rank, k, s=0.1), draw(n, rank, s=0.1)
    y = nf4_matvec(x, packed, state, norm_weight=norm, eps=eps, lora=(a, b, scale), residual=residual)
    x64 = x.double().cpu()
    # Qwen3RMSNorm's roundings: the normalized x to bf16, then times the weight, to bf16 again.
    normed = (x64 * torch.rsqrt((x64 * x64).mean(-1, keepdim=True) + eps)).to(torch.bfloat16).double()
    normed = (normed * norm.double().cpu()).to(torch.bfloat16).double()
    want = (residual.double().cpu() + normed @ as_used(decoded64(packed, state)).T
            + scale * (normed @ a.double().cpu().T) @ b.double().cpu().T)
    assert rel(y, want) <= 4e-3
    # each part matters: without the LoRA term or the residual the result is far off
    assert rel(y, want - residual.double().cpu()) > 0.1
    assert rel(y, want - scale * (normed @ a.double().cpu().T) @ b.double().cpu().T) > 1e-2
