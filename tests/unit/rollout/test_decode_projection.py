"""decode_projection.project against float64 references: NF4 (bitsandbytes' own tensors) and dense weights.

The NF4 reference decodes the packed bytes from the layout's definition (and
that decoding is first checked against bitsandbytes' `dequantize_4bit`, so the
kernel is held to bitsandbytes' format, not to a reading of it that only the
kernel shares), rounds the weights to bf16 as bitsandbytes' matmul does, and
chains norm, products, LoRA, SiLU and residual in float64. CPU: Triton's interpreter; CUDA:
the GPU, tensor-core dots included.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="needs Triton (the dev extra installs it)")
tl = pytest.importorskip("triton.language")
bnb_functional = pytest.importorskip("bitsandbytes.functional")
from miniverl.engine.rollout.decode_projection import (  # noqa: E402
    PRODUCT_BROADCAST, PRODUCT_BROADCAST_AT_ONCE, Tiles, Weight, project, round_to_dtype, stack_lora_a,
    tile_config)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# How the tiles multiply (decode_projection._product): float32 dots, broadcast sums, and on a GPU tensor-core
# dots (Triton's interpreter has none).
PRODUCTS = [0, 2] + ([1] if DEVICE == "cuda" else [])
DOT_PRODUCTS = [p for p in PRODUCTS if p != 2]  # what the swapped tiles (weights as the left operand) take


def draw(gen, *shape, s=1.0):
    return (s * torch.randn(*shape, generator=gen)).to(torch.bfloat16).to(DEVICE)


def decoded64(packed: torch.Tensor, state) -> torch.Tensor:
    """The weight in float64 from the layout: high nibble first, one absmax per 64, nested absmax if any."""
    data = packed.view(-1).cpu().long()
    nibbles = torch.stack([data >> 4, data & 15], dim=1).view(-1)
    if state.nested:
        level2 = state.state2.absmax.cpu().double().repeat_interleave(256)[: state.absmax.numel()]
        absmax = state.state2.code.cpu().double()[state.absmax.cpu().long()] * level2 + float(state.offset)
    else:
        absmax = state.absmax.cpu().double()
    return (state.code.cpu().double()[nibbles] * absmax.repeat_interleave(64)).view(*state.shape)


def quantized(weight: torch.Tensor, nested: bool):
    return bnb_functional.quantize_4bit(weight, blocksize=64, compress_statistics=nested, quant_type="nf4",
                                        quant_storage=torch.uint8)


@pytest.mark.parametrize("nested", [True, False], ids=["double-quantized", "single"])
def test_the_reference_decoding_is_bitsandbytes_own(nested: bool):
    packed, state = quantized(draw(torch.Generator().manual_seed(0), 96, 256), nested)
    ours = decoded64(packed, state)
    theirs = bnb_functional.dequantize_4bit(packed, state).double().cpu()  # rounded to bf16
    assert float((ours - theirs).abs().max()) <= float(theirs.abs().max()) * 2**-8


def make(kind: str, n: int, k: int, rank: int, gen) -> tuple[Weight, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Weight, the weight as used in float64, A, B): NF4 double- or single-quantized ("nf4", "nf4-single"), or
    a dense bf16 weight."""
    dense = draw(gen, n, k, s=0.05)
    a, b = draw(gen, rank, k, s=0.1), draw(gen, n, rank, s=0.1)
    if kind == "dense":
        return Weight(n, k, dense, lora_a=a, lora_b=b), dense.double().cpu(), a, b
    packed, state = quantized(dense, nested=kind == "nf4")
    used = decoded64(packed, state).to(torch.bfloat16).double()
    return Weight.nf4(packed, state, a, b), used, a, b


def normed64(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm's roundings: the normalized x to bf16, then times the weight, to bf16 again."""
    x64 = x.double().cpu()
    normed = (x64 * torch.rsqrt((x64 * x64).mean(-1, keepdim=True) + eps)).to(torch.bfloat16).double()
    return (normed * gamma.double().cpu()).to(torch.bfloat16).double()


def linear64(x64, used, a, b):
    return x64 @ used.T + (x64 @ a.double().cpu().T) @ b.double().cpu().T


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double().cpu() - want).norm() / want.norm())


@pytest.mark.parametrize("kind", ["nf4", "nf4-single", "dense"])
@pytest.mark.parametrize("product", PRODUCTS)
@pytest.mark.parametrize("batch", [1, 5, 17])  # one row, a ragged tile, two batch tiles
def test_three_weights_side_by_side_with_norm(kind: str, product: int, batch: int, stacked: bool = False,
                                               swap: bool = False):
    gen = torch.Generator().manual_seed(batch)
    k, eps = 192, 1e-6
    parts = [make(kind, n, k, 8, gen) for n in (96, 40, 40)]  # q, k, v: ragged widths, tiles straddle parts
    x, gamma = draw(gen, batch, k, s=3.0), draw(gen, k, s=0.5)
    weights = [w for w, *_ in parts]
    y = project(x, weights, norm_weight=gamma, eps=eps, product=product, block_n=32, block_k=64,
                lora_a_stacked=stack_lora_a(weights) if stacked else None, swap=swap)
    assert y.shape == (batch, 176) and y.dtype == torch.bfloat16
    x64 = normed64(x, gamma, eps)
    want = torch.cat([linear64(x64, used, a, b) for _, used, a, b in parts], dim=1)
    assert rel(y, want) <= 4e-3  # the output's bf16 rounding; the arithmetic is float32
    k_part, v_part = (linear64(x64, used, a, b) for _, used, a, b in parts[1:])
    assert rel(y[:, 96:136], v_part) > 0.3 and rel(y[:, 136:], k_part) > 0.3  # each part reads its own weight


@pytest.mark.parametrize("kind", ["nf4", "dense"])
@pytest.mark.parametrize("batch", [1, 17])
def test_x_times_a_once_per_launch_is_the_same_projection(kind: str, batch: int):
    """lora_a_stacked: norm(x) @ A.T by `_lora_down` once, read by every program, against float64."""
    test_three_weights_side_by_side_with_norm(kind, PRODUCTS[0], batch, stacked=True)


@pytest.mark.parametrize("kind", ["nf4", "dense"])
@pytest.mark.parametrize("batch", [1, 3, 8, 17])
def test_the_tiles_a_gpu_takes_are_the_same_projection(kind: str, batch: int):
    """Each launch `tile_config` picks on a GPU (in the interpreter float32 dots for tensor-core ones), with the A
    matrices stacked as fused_step passes them: against float64, and A per program where the tiles say so (the
    tiles at most 128 wide, so that K 256 is split where the tiles split it)."""
    gen = torch.Generator().manual_seed(batch)
    k, eps = 256, 1e-6
    parts = [make(kind, n, k, 8, gen) for n in (96, 40, 40)]
    weights = [w for w, *_ in parts]
    x, gamma = draw(gen, batch, k, s=3.0), draw(gen, k, s=0.5)
    tiles = tile_config(batch, on_gpu=True, dense=kind == "dense", parts=3)
    assert tiles.swap == (kind == "dense" and batch > 4)  # swapped tensor-core tiles: dense weights past 4 rows
    product = tiles.product if tiles.product in PRODUCTS else 0  # the interpreter's dot for a tensor-core one
    counters = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    y = project(x, weights, norm_weight=gamma, eps=eps, product=product, block_n=tiles.block_n,
                block_k=min(tiles.block_k, 128), swap=tiles.swap, num_stages=tiles.num_stages,
                a_per_program=tiles.a_per_program, lora_a_stacked=stack_lora_a(weights), split_k=tiles.split_k,
                split_counters=counters, lora_sync=torch.zeros(2, dtype=torch.int32, device=DEVICE))
    x64 = normed64(x, gamma, eps)
    assert rel(y, torch.cat([linear64(x64, used, a, b) for _, used, a, b in parts], dim=1)) <= 4e-3
    assert not counters.any()
    # gate and up, with the tiles a SiLU·mul launch takes (NF4 up to 8 rows: 4-row tiles)
    (gate, g64, ga, gb), (up, u64, ua, ub) = make(kind, 64, k, 8, gen), make(kind, 64, k, 8, gen)
    tiles = tile_config(batch, on_gpu=True, dense=kind == "dense", silu_mul=True)
    broadcast = batch <= (8 if kind == "nf4" else 4)
    assert tiles.block_n == (4 if kind == "nf4" and batch <= 8 else 8 if broadcast else 32)
    product = tiles.product if tiles.product in PRODUCTS else 0
    act = project(x, [gate, up], norm_weight=gamma, eps=eps, silu_mul=True, product=product, block_n=tiles.block_n,
                  block_k=min(tiles.block_k, 128), swap=tiles.swap, num_stages=tiles.num_stages,
                  a_per_program=tiles.a_per_program, lora_a_stacked=stack_lora_a([gate, up]), split_k=tiles.split_k,
                  split_counters=counters, lora_sync=torch.zeros(2, dtype=torch.int32, device=DEVICE),
                  pair=tiles.pair)
    g, u = linear64(x64, g64, ga, gb), linear64(x64, u64, ua, ub)
    assert rel(act, g * torch.sigmoid(g) * u) <= 1e-2
    assert not counters.any()
    # one weight and a residual (o_proj, down_proj): with an adapter every row's sums at once up to 8 rows
    (down, d64, da, db), residual = make(kind, 48, k, 8, gen), draw(gen, batch, 48, s=2.0)
    tiles = tile_config(batch, on_gpu=True, dense=kind == "dense")
    assert tiles.swap == (kind == "dense" and batch > 8)
    product = tiles.product if tiles.product in PRODUCTS else 0
    y = project(x, [down], residual=residual, product=product, block_n=tiles.block_n,
                block_k=min(tiles.block_k, 128), swap=tiles.swap, num_stages=tiles.num_stages,
                a_per_program=tiles.a_per_program, lora_a_stacked=stack_lora_a([down]), split_k=tiles.split_k,
                split_counters=counters, lora_sync=torch.zeros(2, dtype=torch.int32, device=DEVICE))
    assert rel(y, residual.double().cpu() + linear64(x.double().cpu(), d64, da, db)) <= 4e-3
    assert not counters.any()


@pytest.mark.parametrize("batch", [3, 8])
def test_the_tiles_a_gpu_takes_for_dense_weights_without_an_adapter(batch: int):
    """A merged dense copy (no adapter): 4-row broadcast tiles up to 4 rows, 64-row swapped tiles with K over up
    to 3 programs up to 8 (`tile_config`, session 13's sweep), the same projection as float64 for a side-by-side
    launch with a norm and for one with a residual, the counters left zeroed."""
    assert tile_config(3, True, dense=True, lora=False) == Tiles(PRODUCT_BROADCAST, 4, 1024, split_k=4)
    assert tile_config(3, True, dense=True) == Tiles(PRODUCT_BROADCAST, 8, 1024, split_k=4)
    assert tile_config(8, True, dense=True, lora=False).split_k == 3 and tile_config(8, True, dense=True, parts=3).split_k == 1
    assert tile_config(17, True, dense=True, lora=False).split_k == 1
    # every row's sums at once from 4 rows for NF4 and for dense weights with an adapter (session 15)
    assert tile_config(4, True, dense=True, lora=False).product == PRODUCT_BROADCAST
    assert [tile_config(b, True).product for b in (1, 3, 4, 8)] == [PRODUCT_BROADCAST] * 2 + [PRODUCT_BROADCAST_AT_ONCE] * 2
    assert tile_config(4, True, dense=True).product == PRODUCT_BROADCAST_AT_ONCE
    # with an adapter at 5-8 rows (session 17): o and down every row at once, gate and up swapped with K over 2
    assert tile_config(8, True, dense=True) == Tiles(PRODUCT_BROADCAST_AT_ONCE, 8, 1024, split_k=4)
    assert tile_config(9, True, dense=True).swap and tile_config(8, True, dense=True, parts=3).split_k == 1
    assert tile_config(8, True, dense=True, silu_mul=True, parts=2).split_k == 2
    assert tile_config(9, True, dense=True, silu_mul=True, parts=2).split_k == 1
    gen = torch.Generator().manual_seed(40 + batch)
    k, eps = 384, 1e-6  # three 128-column tiles: split 3 takes one each
    dense = [draw(gen, n, k, s=0.05) for n in (96, 40, 48)]
    x, gamma, residual = draw(gen, batch, k, s=3.0), draw(gen, k, s=0.5), draw(gen, batch, 48, s=2.0)
    tiles = tile_config(batch, on_gpu=True, dense=True, lora=False)
    product = tiles.product if tiles.product in PRODUCTS else 0  # the interpreter's dot for a tensor-core one
    counters = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    options = dict(product=product, block_n=tiles.block_n, block_k=min(tiles.block_k, 128), swap=tiles.swap,
                   num_stages=tiles.num_stages, split_k=tiles.split_k, split_counters=counters)
    y = project(x, [Weight(w.shape[0], k, w) for w in dense[:2]], norm_weight=gamma, eps=eps, **options)
    x64 = normed64(x, gamma, eps)
    assert rel(y, torch.cat([x64 @ w.double().cpu().T for w in dense[:2]], dim=1)) <= 4e-3
    y = project(x, [Weight(48, k, dense[2])], residual=residual, **options)
    assert rel(y, residual.double().cpu() + x.double().cpu() @ dense[2].double().cpu().T) <= 4e-3
    assert not counters.any()


@pytest.mark.parametrize("kind", ["nf4", "dense"])
@pytest.mark.parametrize("product", PRODUCTS)
@pytest.mark.parametrize("batch", [1, 5])
def test_x_times_a_in_the_projections_own_launch_is_bit_for_bit_the_separate_one(kind: str, product: int,
                                                                                   batch: int):
    """lora_sync: `_lora_down`'s programs lead the projection's launch and publish x @ A.T through two counters:
    the same bits as its own launch, for three weights with a norm, SiLU·mul and a residual, and the counters left
    zeroed (a replayed CUDA graph reuses them); twice over the same counters, the second launch as the first."""
    gen = torch.Generator().manual_seed(11 + batch)
    k, eps = 192, 1e-6
    qkv = [make(kind, n, k, 8, gen)[0] for n in (96, 40, 40)]
    gate, up = (make(kind, 64, k, 8, gen)[0] for _ in range(2))
    down = make(kind, k, 64, 8, gen)[0]
    x, gamma = draw(gen, batch, k, s=3.0), draw(gen, k, s=0.5)
    sync = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    tiles = {"product": product, "block_n": 32, "block_k": 64}
    for _ in range(2):
        for weights, options in ((qkv, {"norm_weight": gamma, "eps": eps}),
                                 ([gate, up], {"norm_weight": gamma, "eps": eps, "silu_mul": True})):
            separate = project(x, weights, **options, **tiles, lora_a_stacked=stack_lora_a(weights))
            fused = project(x, weights, **options, **tiles, lora_a_stacked=stack_lora_a(weights), lora_sync=sync)
            assert torch.equal(fused, separate)
            assert sync.tolist() == [0, 0]
        act = project(x, [gate, up], norm_weight=gamma, eps=eps, silu_mul=True, **tiles)
        separate = project(act, [down], residual=x, **tiles, lora_a_stacked=stack_lora_a([down]))
        fused = project(act, [down], residual=x, **tiles, lora_a_stacked=stack_lora_a([down]), lora_sync=sync)
        assert torch.equal(fused, separate) and sync.tolist() == [0, 0]
        without_lora = project(act, [Weight(down.n, down.k, down.data, down.absmax, down.absmax2, down.code,
                                            down.code2, down.offset, down.nested)], residual=x, **tiles)
        assert rel(fused, without_lora.double().cpu()) > 1e-3  # the adapter is in it


@pytest.mark.parametrize("kind", ["nf4", "dense"])
@pytest.mark.parametrize("product", PRODUCTS)
@pytest.mark.parametrize("stacked", [False, True], ids=["a-per-program", "a-once"])
def test_gate_up_silu_mul_and_residual(kind: str, product: int, stacked: bool, swap: bool = False):
    gen = torch.Generator().manual_seed(3)
    batch, k, n, eps = 3, 128, 192, 1e-6
    (gate, g64, ga, gb), (up, u64, ua, ub) = make(kind, n, k, 4, gen), make(kind, n, k, 4, gen)
    x, gamma = draw(gen, batch, k, s=2.0), draw(gen, k, s=0.5)
    y = project(x, [gate, up], norm_weight=gamma, eps=eps, silu_mul=True, product=product, block_n=32, block_k=64,
                lora_a_stacked=stack_lora_a([gate, up]) if stacked else None, swap=swap)
    x64 = normed64(x, gamma, eps)
    g, u = linear64(x64, g64, ga, gb), linear64(x64, u64, ua, ub)
    assert rel(y, g * torch.sigmoid(g) * u) <= 1e-2  # gate, up and SiLU each rounded to bf16, as the modules do
    assert rel(y, g * u) > 0.1
    down, d64, da, db = make(kind, 48, n, 4, gen)
    residual = draw(gen, batch, 48, s=2.0)
    z = project(y, [down], residual=residual, product=product, block_n=16, block_k=64,
                lora_a_stacked=stack_lora_a([down]) if stacked else None, swap=swap)
    want = residual.double().cpu() + linear64(y.double().cpu(), d64, da, db)
    assert rel(z, want) <= 4e-3
    assert rel(z, want - residual.double().cpu()) > 0.1


@pytest.mark.parametrize("kind", ["nf4", "dense"])
@pytest.mark.parametrize("batch", [1, 5, 8])
def test_broadcast_sums_over_every_row_at_once_are_the_same_projection(kind: str, batch: int):
    """PRODUCT_BROADCAST_AT_ONCE: the broadcast products of all of x's rows reduced over K together, against
    float64 for three weights with a norm, SiLU·mul with a residual (A per program and x @ A.T once), and K split
    over programs."""
    product = PRODUCT_BROADCAST_AT_ONCE
    test_three_weights_side_by_side_with_norm(kind, product, batch)
    for stacked in (False, True):
        test_gate_up_silu_mul_and_residual(kind, product, stacked)
    test_k_split_across_programs_is_the_same_projection(kind, product, False, batch)


@pytest.mark.parametrize("kind", ["nf4", "nf4-single", "dense"])
@pytest.mark.parametrize("product", DOT_PRODUCTS)
@pytest.mark.parametrize("batch", [1, 5, 17])
@pytest.mark.parametrize("stacked", [False, True], ids=["a-per-program", "a-once"])
def test_swapped_tiles_are_the_same_projection(kind: str, product: int, batch: int, stacked: bool):
    """swap: the weight tile as the dots' left operand, x transposed, accumulated [N, B] and transposed back."""
    test_three_weights_side_by_side_with_norm(kind, product, batch, stacked=stacked, swap=True)


@pytest.mark.parametrize("kind", ["nf4", "dense"])
@pytest.mark.parametrize("product", DOT_PRODUCTS)
@pytest.mark.parametrize("stacked", [False, True], ids=["a-per-program", "a-once"])
def test_swapped_tiles_silu_mul_and_residual(kind: str, product: int, stacked: bool):
    test_gate_up_silu_mul_and_residual(kind, product, stacked, swap=True)


@pytest.mark.parametrize("kind", ["nf4", "dense"])
@pytest.mark.parametrize("product,swap", [(p, False) for p in PRODUCTS] + [(p, True) for p in DOT_PRODUCTS])
@pytest.mark.parametrize("batch", [1, 17])
def test_k_split_across_programs_is_the_same_projection(kind: str, product: int, swap: bool, batch: int):
    """split_k: each tile's K over several programs, the last of them summing the partials and adding LoRA and
    residual: against float64 for three weights with a norm, SiLU·mul and a residual (x @ A.T in the launch's own
    programs, or each program's share of it times B in its partial), close to the unsplit launch, the counters
    left zeroed for the next launch (twice over the same counters), and each tile's counter counts two programs
    at split 2 (so the split did happen)."""
    gen = torch.Generator().manual_seed(5 + batch)
    k, eps = 192, 1e-6  # three 64-column tiles: split 2 takes two and one, split 4 one each
    qkv = [make(kind, n, k, 8, gen) for n in (96, 40, 40)]
    gate, up = make(kind, 64, k, 8, gen), make(kind, 64, k, 8, gen)
    down = make(kind, 48, k, 8, gen)
    x, gamma, residual = draw(gen, batch, k, s=3.0), draw(gen, k, s=0.5), draw(gen, batch, 48, s=2.0)
    x64 = normed64(x, gamma, eps)
    counters = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    sync = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    tiles = {"product": product, "block_n": 16, "block_k": 64, "swap": swap}
    launches = [
        ([w for w, *_ in qkv], {"norm_weight": gamma, "eps": eps},
         torch.cat([linear64(x64, used, a, b) for _, used, a, b in qkv], dim=1), x),
        ([gate[0], up[0]], {"norm_weight": gamma, "eps": eps, "silu_mul": True},
         linear64(x64, gate[1], gate[2], gate[3]) * torch.sigmoid(linear64(x64, gate[1], gate[2], gate[3]))
         * linear64(x64, up[1], up[2], up[3]), x),
        ([down[0]], {"residual": residual},
         residual.double().cpu() + linear64(x.double().cpu(), down[1], down[2], down[3]), x),
    ]
    for split, repeats, once in ((2, 2, True), (4, 1, True), (2, 1, False)):
        for weights, options, want, inputs in launches:  # once: x @ A.T by the launch's first programs
            lora = {"lora_a_stacked": stack_lora_a(weights), "lora_sync": sync} if once else {"a_per_program": True}
            whole = project(inputs, weights, **options, **tiles, **lora)
            for _ in range(repeats):
                got = project(inputs, weights, **options, **tiles, **lora, split_k=split, split_counters=counters)
                assert rel(got, want) <= 1e-2 and rel(got, whole.double().cpu()) <= 1e-2
                assert not counters.any() and sync.tolist() == [0, 0]
    held = torch.full((64,), 100, dtype=torch.int32, device=DEVICE)  # no program is ever last: nothing resets them
    project(x, [down[0]], residual=residual, **tiles, lora_a_stacked=stack_lora_a([down[0]]), split_k=2,
            split_counters=held)
    tiles_used = 3 * ((batch + 15) // 16)  # 48 rows / 16 a tile, times the blocks of 16 rows of x
    assert held[:tiles_used].tolist() == [102] * tiles_used and (held[tiles_used:] == 100).all()  # 2 programs each
    with pytest.raises(ValueError, match="split_counters"):
        project(x, [down[0]], residual=residual, **tiles, lora_a_stacked=stack_lora_a([down[0]]), split_k=2,
                split_counters=torch.zeros(1, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("kind", ["nf4", "dense"])
@pytest.mark.parametrize("product", PRODUCTS)
def test_gate_and_up_in_one_loop_are_the_two_loops_bit_for_bit(kind: str, product: int):
    """pair: gate's and up's weight tiles read in one loop give the same bits as gate's loop, then up's."""
    gen = torch.Generator().manual_seed(9)
    gate, up = make(kind, 64, 192, 8, gen)[0], make(kind, 64, 192, 8, gen)[0]
    x, gamma = draw(gen, 5, 192, s=3.0), draw(gen, 192, s=0.5)
    for stacked in (None, stack_lora_a([gate, up])):
        one, two = (project(x, [gate, up], norm_weight=gamma, silu_mul=True, product=product, block_n=16,
                            block_k=64, lora_a_stacked=stacked, pair=pair) for pair in (True, False))
        assert torch.equal(one, two)


@pytest.mark.parametrize("kind", ["nf4", "dense"])
def test_a_broadcast_tile_as_wide_as_k_is_the_same_projection(kind: str):
    """span_k: broadcast tiles as wide as K (64 x 2 for K 192 here: 256 columns, 64 of them masked) against
    float64."""
    gen = torch.Generator().manual_seed(13)
    down, d64, da, db = make(kind, 48, 192, 8, gen)
    x, residual = draw(gen, 3, 192, s=2.0), draw(gen, 3, 48, s=2.0)
    got = project(x, [down], residual=residual, product=2, block_n=8, block_k=64, span_k=True,
                  lora_a_stacked=stack_lora_a([down]), lora_sync=torch.zeros(2, dtype=torch.int32, device=DEVICE))
    want = residual.double().cpu() + linear64(x.double().cpu(), d64, da, db)
    assert rel(got, want) <= 4e-3 and rel(got, want - residual.double().cpu()) > 0.1


def test_refuses_mixed_launches():
    gen = torch.Generator().manual_seed(0)
    nf4, *_ = make("nf4", 32, 64, 4, gen)
    dense, *_ = make("dense", 32, 64, 4, gen)
    x = draw(gen, 2, 64)
    with pytest.raises(ValueError, match="must share K, their kind"):
        project(x, [nf4, dense])
    with pytest.raises(ValueError, match="1-3 weights"):
        project(x, [nf4], silu_mul=True)
    with pytest.raises(ValueError, match=r"x must be \[B, 64\]"):
        project(draw(gen, 2, 32), [nf4])
    with pytest.raises(ValueError, match="in_features a multiple of 64; got 80"):
        make("nf4", 32, 80, 4, gen)
    with pytest.raises(ValueError, match="swap takes a dot product"):
        project(x, [nf4], product=2, swap=True)


def test_the_bf16_rounding_by_conversion_is_only_for_compiled_kernels(monkeypatch):
    """DTYPE 3 (the GPU's bf16 conversion) only where a compiled kernel runs: Triton's interpreter truncates that
    cast, so on a CPU, and under TRITON_INTERPRET, bf16 keeps the bit arithmetic (DTYPE 0)."""
    from miniverl.engine.rollout import decode_projection
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert decode_projection.dtype_code(torch.bfloat16, cuda) == 3
    assert decode_projection.dtype_code(torch.bfloat16, cpu) == 0 and decode_projection.dtype_code(torch.bfloat16) == 0
    assert decode_projection.dtype_code(torch.float16, cuda) == 1 and decode_projection.dtype_code(torch.float32, cuda) == 2
    monkeypatch.setattr(decode_projection, "HARDWARE_BF16_ROUNDING", False)
    assert decode_projection.dtype_code(torch.bfloat16, cuda) == 0
    monkeypatch.setattr(decode_projection, "HARDWARE_BF16_ROUNDING", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert decode_projection.dtype_code(torch.bfloat16, cuda) == 0


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device: the conversion runs only in compiled kernels")
@pytest.mark.parametrize("kind", ["nf4", "dense"])
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_gpu_bf16_rounding_by_conversion_is_bit_for_bit_the_bit_arithmetic(monkeypatch, kind: str, batch: int):
    """The projections as the step launches them (tile_config's tiles, x @ A.T in the launch, SiLU * up and the
    residual) give the same bits with bf16 rounded by the conversion (DTYPE 3) as by the bit arithmetic (0)."""
    from miniverl.engine.rollout import decode_projection
    gen = torch.Generator().manual_seed(batch)
    k = 1024
    qkv = [make(kind, n, k, 16, gen)[0] for n in (256, 128, 128)]
    gate_up = [make(kind, 512, k, 16, gen)[0] for _ in range(2)]
    down = make(kind, k, 512, 16, gen)[0]
    x, gamma, residual = draw(gen, batch, k, s=3.0), draw(gen, k, s=0.5), draw(gen, batch, k, s=2.0)

    def launches():
        sync = [torch.zeros(2, dtype=torch.int32, device=DEVICE) for _ in range(3)]
        counters = [torch.zeros(4096, dtype=torch.int32, device=DEVICE) for _ in range(3)]
        a = project(x, qkv, norm_weight=gamma, lora_a_stacked=stack_lora_a(qkv), lora_sync=sync[0],
                    split_counters=counters[0])
        act = project(x, gate_up, norm_weight=gamma, silu_mul=True, lora_a_stacked=stack_lora_a(gate_up),
                      lora_sync=sync[1], split_counters=counters[1])
        b = project(act, [down], residual=residual, lora_a_stacked=stack_lora_a([down]), lora_sync=sync[2],
                    split_counters=counters[2])
        return a, act, b

    by_conversion = launches()
    monkeypatch.setattr(decode_projection, "HARDWARE_BF16_ROUNDING", False)
    by_bits = launches()
    for got, want in zip(by_conversion, by_bits):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@triton.jit
def _rounded(v_ptr, out_ptr, DTYPE: tl.constexpr):
    at = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    tl.store(out_ptr + at, round_to_dtype(tl.load(v_ptr + at), DTYPE))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device: the conversion runs only in compiled kernels")
def test_gpu_bf16_conversion_rounds_every_value_as_the_bit_arithmetic():
    """round_to_dtype's DTYPE 3 against DTYPE 0 on random floats over many magnitudes and on exact halfway
    points (ties to even), bit for bit."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(1 << 16, generator=gen) * torch.exp2(torch.randint(-40, 40, (1 << 16,), generator=gen))
    ties = (values.to(torch.bfloat16).float().view(torch.int32) | 0x8000).view(torch.float32)  # exactly halfway
    v = torch.cat([values, ties]).to(DEVICE)
    got, want = torch.empty_like(v), torch.empty_like(v)
    _rounded[(v.numel() // 1024,)](v, got, DTYPE=3)
    _rounded[(v.numel() // 1024,)](v, want, DTYPE=0)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(want.cpu(), v.cpu().to(torch.bfloat16).float())  # both: torch's round to nearest, ties even
