"""decode_attention against float64 softmax attention (CPU: Triton's interpreter; CUDA: the GPU)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="needs Triton (the dev extra installs it)")
from miniverl.engine.rollout.decode_attention import (COUNTERS, attend_new_token, decode_attention,  # noqa: E402
                                                      qk_norm_rope_append, split_keys)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, k_cache, v_cache, positions) -> torch.Tensor:
    """Per slot and head, from the definition, in float64: keys 0..position, the kv head its group shares."""
    slots, heads, dim = q.shape
    group = heads // k_cache.shape[1]
    out = torch.zeros(slots, heads, dim, dtype=torch.float64)
    for s in range(slots):
        last = int(positions[s])
        for h in range(heads):
            keys = k_cache[s, h // group, : last + 1].double().cpu()
            values = v_cache[s, h // group, : last + 1].double().cpu()
            weights = torch.softmax(keys @ q[s, h].double().cpu() / math.sqrt(dim), dim=0)
            out[s, h] = weights @ values
    return out


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (6, 6, 32), (8, 1, 16)], ids=["gqa2", "mha", "mqa8"])
@pytest.mark.parametrize("split_len,block_l", [(None, None), (16, 16), (32, 16)], ids=["default", "16", "32-by-16"])
def test_matches_float64_at_different_positions_per_slot(heads: int, kv_heads: int, dim: int, split_len, block_l):
    gen = torch.Generator().manual_seed(heads * dim)
    slots, max_len = 3, 300  # splits of 32 keys (the default at 3 slots), the last one partial
    q = torch.randn(slots, heads, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    k = (2 * torch.randn(slots, kv_heads, max_len, dim, generator=gen)).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(slots, kv_heads, max_len, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    positions = torch.tensor([0, 130, 299], device=DEVICE)  # one key; just past a split; the whole cache
    got = decode_attention(q, k, v, positions, split_len=split_len, block_l=block_l)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    want = reference(q, k, v, positions)
    assert float((got.double().cpu() - want).norm() / want.norm()) <= 4e-3
    # keys past a slot's position are never read: changing them changes nothing
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 1:], v2[1, :, 131:] = 100.0, -100.0
    assert torch.equal(decode_attention(q, k2, v2, positions, split_len=split_len, block_l=block_l), got)


def test_one_slot_takes_splits_of_16_keys():
    """split_keys: one slot's splits are 16 keys (read at once), more slots' 32; one slot through the default
    matches float64 and the explicit split of 16 bit for bit."""
    assert split_keys(1) == (16, 16) and split_keys(3) == (32, 32) and split_keys(8) == (32, 16)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    k, v = (torch.randn(1, 2, 100, 64, generator=gen).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    positions = torch.tensor([70], device=DEVICE)
    got = decode_attention(q, k, v, positions)
    assert torch.equal(got, decode_attention(q, k, v, positions, split_len=16, block_l=16))
    want = reference(q, k, v, positions)
    assert float((got.double().cpu() - want).norm() / want.norm()) <= 4e-3


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (16, 1, 32)], ids=["gqa2", "dot16"])
def test_the_prologue_inside_the_split_programs_is_the_two_launches_bit_for_bit(heads: int, kv_heads: int,
                                                                                 dim: int):
    """attend_new_token (q_norm, k_norm, rotary and the append in the split-key programs) against
    qk_norm_rope_append then decode_attention: the same output and the same caches, bit for bit, for slots whose
    new key falls at a split's first, inner and last position; and the new key is in the attention (a cache
    missing it gives a different output)."""
    gen = torch.Generator().manual_seed(heads + dim)
    slots, max_len, eps = 4, 100, 1e-6
    qkv = (3 * torch.randn(slots, (heads + 2 * kv_heads) * dim, generator=gen)).to(torch.bfloat16).to(DEVICE)
    q_weight, k_weight = ((1 + 0.3 * torch.randn(dim, generator=gen)).to(torch.bfloat16).to(DEVICE)
                          for _ in range(2))
    angles = torch.arange(max_len)[:, None] * torch.rand(dim // 2, generator=gen)[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], dim=1).to(torch.bfloat16).to(DEVICE)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=1).to(torch.bfloat16).to(DEVICE)
    k = torch.randn(slots, kv_heads, max_len, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(slots, kv_heads, max_len, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    positions = torch.tensor([0, 32, 45, 63], device=DEVICE)  # splits of 32: first, first, inner, last
    k_two, v_two, k_one, v_one = k.clone(), v.clone(), k.clone(), v.clone()
    q = qk_norm_rope_append(qkv, q_weight, k_weight, eps, cos, sin, positions, k_two, v_two)
    want = decode_attention(q, k_two, v_two, positions)
    got = attend_new_token(qkv, q_weight, k_weight, eps, cos, sin, positions, k_one, v_one)
    assert torch.equal(got, want)
    assert torch.equal(k_one, k_two) and torch.equal(v_one, v_two)
    assert not torch.equal(k_one, k) and not torch.equal(v_one, v)  # the new entries were written
    assert not torch.equal(decode_attention(q, k, v, positions), want)  # and they count


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (16, 1, 32)], ids=["gqa2", "dot16"])
@pytest.mark.parametrize("split_len", [None, 16])
def test_the_combine_in_the_split_launch_is_the_separate_combine_bit_for_bit(heads: int, kv_heads: int, dim: int,
                                                                              split_len):
    """With counters the last split program of each (slot, kv head) combines its query heads' splits: the same
    bits as the combine's own launch, for slots of one key and at a split's first, inner and last key, through
    decode_attention and attend_new_token; the counters are left zeroed, so a second launch (a replay) reuses
    them and gives the same again. Keys past a position are still never read."""
    gen = torch.Generator().manual_seed(heads * 7 + dim)
    slots, max_len, eps = 4, 100, 1e-6
    q = torch.randn(slots, heads, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    k = (2 * torch.randn(slots, kv_heads, max_len, dim, generator=gen)).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(slots, kv_heads, max_len, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    positions = torch.tensor([0, 32, 45, 99], device=DEVICE)
    counters = torch.zeros(COUNTERS, dtype=torch.int32, device=DEVICE)
    want = decode_attention(q, k, v, positions, split_len=split_len)
    for _ in range(2):
        got = decode_attention(q, k, v, positions, split_len=split_len, counters=counters)
        assert torch.equal(got, want) and not torch.any(counters)
    k[0, :, 1:], v[1, :, 33:] = 100.0, -100.0
    assert torch.equal(decode_attention(q, k, v, positions, split_len=split_len, counters=counters), want)
    assert float((want.double().cpu() - reference(q, k, v, positions)).norm()) <= 4e-3 * float(want.double().norm())

    qkv = (3 * torch.randn(slots, (heads + 2 * kv_heads) * dim, generator=gen)).to(torch.bfloat16).to(DEVICE)
    weights = [(1 + 0.3 * torch.randn(dim, generator=gen)).to(torch.bfloat16).to(DEVICE) for _ in range(2)]
    angles = torch.arange(max_len)[:, None] * torch.rand(dim // 2, generator=gen)[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], dim=1).to(torch.bfloat16).to(DEVICE)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=1).to(torch.bfloat16).to(DEVICE)
    k_two, v_two, k_one, v_one = k.clone(), v.clone(), k.clone(), v.clone()
    want = attend_new_token(qkv, *weights, eps, cos, sin, positions, k_two, v_two, split_len=split_len)
    got = attend_new_token(qkv, *weights, eps, cos, sin, positions, k_one, v_one, split_len=split_len,
                           counters=counters)
    assert torch.equal(got, want) and torch.equal(k_one, k_two) and torch.equal(v_one, v_two)
    assert not torch.any(counters)
    with pytest.raises(ValueError, match="counters must be int32"):
        decode_attention(q, k, v, positions, counters=torch.zeros(slots * kv_heads - 1, dtype=torch.int32,
                                                                  device=DEVICE))


def test_refuses_shapes_it_cannot_read():
    q = torch.zeros(2, 6, 32, dtype=torch.bfloat16, device=DEVICE)
    cache = torch.zeros(2, 4, 16, 32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="a multiple of kv_heads"):
        decode_attention(q, cache, cache, torch.zeros(2, dtype=torch.long, device=DEVICE))
