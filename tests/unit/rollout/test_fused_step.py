"""StaticDecoder(kernels=True) against the module-by-module step, on a Qwen3 with a non-zero LoRA adapter,
its projections NF4 or bf16.

CPU: bitsandbytes quantizes the tiny model's projections to NF4 here, and the
Triton kernels run under the interpreter. Both decoders prefill the same
prompts into slots at different lengths, then take the same greedy tokens;
every step's logits must agree with a full forward pass of the peft model (and
with the module step) to bf16 rounding, and differ from those of the same model
without its adapter (so the tolerance can tell LoRA from no LoRA).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="needs Triton (the dev extra installs it)")
bnb = pytest.importorskip("bitsandbytes")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_model(nf4: bool, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    """A 2-layer Qwen3 (GQA 4/2, head_dim 16) in `dtype`, every projection an NF4 Linear4bit if `nf4`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    model = Qwen3ForCausalLM(config).to(dtype).eval()
    for layer in model.model.layers if nf4 else []:
        for owner in (layer.self_attn, layer.mlp):
            for name in PROJECTIONS:
                dense = getattr(owner, name, None)
                if dense is None:
                    continue
                quantized = bnb.nn.Linear4bit(dense.in_features, dense.out_features, bias=False,
                                              compute_dtype=dtype, quant_type="nf4", compress_statistics=True)
                quantized.weight = bnb.nn.Params4bit(dense.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                                     compress_statistics=True)
                setattr(owner, name, quantized.to(DEVICE))
    return model.to(DEVICE)


def with_lora(model, seed: int = 7):
    from miniverl.engine.core.recipe import LoraSpec
    from miniverl.engine.models.loading import attach_lora

    model = attach_lora(model, LoraSpec(r=8, alpha=16.0), seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("nf4", [True, False], ids=["nf4", "bf16"])
@torch.no_grad()
def test_kernel_step_matches_the_module_step(nf4: bool):
    from miniverl.engine.rollout.cuda_graph import StaticDecoder

    model = with_lora(tiny_model(nf4))
    plain = StaticDecoder(model, slots=3, max_len=64, use_graph=False)
    fused = StaticDecoder(model, slots=3, max_len=64, use_graph=False, kernels=True)
    assert plain.fused is None and fused.fused is not None
    prompts = [[5, 9, 17, 33], [7, 1], [60, 61, 62, 63, 64, 65, 66]]  # different lengths per slot
    for decoder in (plain, fused):
        decoder.prefill([0, 1, 2], prompts)
    positions = [len(p) for p in prompts]
    tokens = plain.logits.argmax(-1).tolist()
    with model.disable_adapter():
        bare = StaticDecoder(model, slots=3, max_len=64, use_graph=False)
        bare.prefill([0, 1, 2], prompts)
    sequences = [list(p) for p in prompts]
    for _ in range(6):
        for decoder in (plain, fused, bare):
            decoder.step(tokens, positions)
        for sequence, token in zip(sequences, tokens):
            sequence.append(token)
        # The reference: a full forward of the peft model over each slot's whole sequence.
        full = torch.stack([model(input_ids=torch.tensor([s], device=DEVICE)).logits[0, -1] for s in sequences])
        gap = rel(fused.logits, full)
        assert gap <= 2e-2 and rel(fused.logits, plain.logits) <= 2e-2, gap
        assert gap <= 2 * rel(plain.logits, full) + 5e-3  # no further from the full forward than the module step
        assert rel(bare.logits, plain.logits) > 5 * gap  # the adapter's effect is far above the tolerance
        tokens, positions = plain.logits.argmax(-1).tolist(), [p + 1 for p in positions]


@pytest.mark.parametrize("nf4", [True, False], ids=["nf4", "fp32"])
@torch.no_grad()
def test_greedy_decoding_in_float32_is_token_for_token_a_full_forward(nf4: bool):
    """A float32 model (NF4 bases dequantized to float32): greedy tokens through the kernels, slot by slot, are
    those of repeated full forward passes of the peft model."""
    from miniverl.engine.rollout.cuda_graph import StaticDecoder

    model = with_lora(tiny_model(nf4, seed=3, dtype=torch.float32))
    decoder = StaticDecoder(model, slots=2, max_len=64, use_graph=DEVICE == "cuda", kernels=True)
    prompts = [[3, 14, 15, 92, 65], [8, 9]]
    decoder.prefill([0, 1], prompts)
    sequences = [list(p) for p in prompts]
    for _ in range(12):
        tokens = decoder.logits.argmax(-1).tolist()
        for sequence, token in zip(sequences, tokens):
            sequence.append(token)
        decoder.step(tokens, [len(s) - 1 for s in sequences])
    reference = []
    for prompt in prompts:
        sequence = list(prompt)
        for _ in range(12):
            logits = model(input_ids=torch.tensor([sequence], device=DEVICE)).logits[0, -1]
            sequence.append(int(logits.argmax()))
        reference.append(sequence)
    assert sequences == reference
    assert len({tuple(s[len(p):]) for s, p in zip(sequences, prompts)}) == 2  # the slots decoded different text


def test_a_model_with_biased_projections_is_refused_by_name():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from miniverl.engine.rollout.cuda_graph import StaticDecoder

    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).to(DEVICE)
    with pytest.raises(ValueError, match="Linear has a bias"):
        StaticDecoder(model, slots=1, max_len=16, use_graph=False, kernels=True)


@pytest.mark.parametrize("nf4", [True, False], ids=["nf4", "bf16"])
def test_auto_takes_the_kernel_step_only_where_it_was_measured_faster(nf4: bool):
    from miniverl.engine.rollout import cuda_graph
    from miniverl.engine.rollout.fused_step import AUTO_MAX_SLOTS, auto_choice

    model = with_lora(tiny_model(nf4))
    body = cuda_graph.base_model(model).model
    most = AUTO_MAX_SLOTS["nf4" if nf4 else "dense"]
    assert auto_choice(body, most) is None
    assert f"faster up to {most}" in auto_choice(body, most + 1)
    # auto on the CPU, or past the measured slot count: the module step; asked for: the kernels
    assert cuda_graph.StaticDecoder(model, slots=1, max_len=16, use_graph=False, kernels=None).fused is None \
        or DEVICE == "cuda"
    assert cuda_graph.StaticDecoder(model, slots=most + 1, max_len=16, use_graph=False, kernels=None).fused is None
    assert cuda_graph.StaticDecoder(model, slots=most + 1, max_len=16, use_graph=False, kernels=True).fused


def decodes_like_the_module_step(model, plain, dense, steps: int) -> None:
    """Prefill both decoders with prompts of different lengths, then feed `plain`'s greedy tokens: every step,
    `dense`'s logits are `plain`'s and a full forward's of the peft model, to bf16 rounding."""
    prompts = [[5, 9, 17, 33], [7, 1], [60, 61, 62, 63, 64, 65, 66]]
    for decoder in (plain, dense):
        decoder.prefill([0, 1, 2], prompts)
    positions, sequences = [len(p) for p in prompts], [list(p) for p in prompts]
    tokens = plain.logits.argmax(-1).tolist()
    for _ in range(steps):
        for decoder in (plain, dense):
            decoder.step(tokens, positions)
        for sequence, token in zip(sequences, tokens):
            sequence.append(token)
        full = torch.stack([model(input_ids=torch.tensor([s], device=DEVICE)).logits[0, -1] for s in sequences])
        assert rel(dense.logits, plain.logits) <= 2e-2 and rel(dense.logits, full) <= 2 * rel(plain.logits, full) + 5e-3
        tokens, positions = plain.logits.argmax(-1).tolist(), [p + 1 for p in positions]


@torch.no_grad()
def test_the_dense_copy_decodes_an_nf4_model_as_its_module_step_does():
    """rollout.dense_copy: the NF4 bases dequantized into one stacked copy per group (the module step here):
    every step's logits those of the module step on the packed weights and of a full forward, to bf16 rounding."""
    from miniverl.engine.rollout.cuda_graph import StaticDecoder

    model = with_lora(tiny_model(nf4=True))
    plain = StaticDecoder(model, slots=3, max_len=64, use_graph=False)
    dense = StaticDecoder(model, slots=3, max_len=64, use_graph=False, kernels=False, dense_copy=True)
    assert dense.fused is None and plain.layers[0]["qkv"].weight is None  # packed: one matmul per base
    stacked = dense.layers[0]["qkv"].weight
    assert stacked is not None and stacked.dtype == torch.bfloat16 and stacked.shape == (64 + 32 + 32, 64)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    q = q_proj.base_layer.weight
    # bitsandbytes' weights with the adapter merged in: W + scaling B A in float32, rounded once
    delta = q_proj.scaling["default"] * q_proj.lora_B["default"].weight.float() @ q_proj.lora_A["default"].weight.float()
    merged = (bnb.functional.dequantize_4bit(q.data, q.quant_state).float() + delta).to(torch.bfloat16)
    assert torch.equal(stacked[:64], merged) and dense.layers[0]["qkv"].merged and not dense.layers[0]["qkv"].b_ts
    decodes_like_the_module_step(model, plain, dense, steps=5)


@torch.no_grad()
def test_the_kernel_step_reads_the_dense_copy_in_place():
    """rollout.dense_copy with the kernel step: the kernels read the stacked copy's rows (views, no further copy,
    the adapter merged in), and every step's logits are the module step's on the packed weights, and a full forward's, to bf16 rounding."""
    from miniverl.engine.rollout.cuda_graph import StaticDecoder

    model = with_lora(tiny_model(nf4=True))
    plain = StaticDecoder(model, slots=3, max_len=64, use_graph=False)
    dense = StaticDecoder(model, slots=3, max_len=64, use_graph=False, kernels=True, dense_copy=True)
    assert dense.fused is not None
    stacked = dense.layers[0]["qkv"].weight
    q, k, v = dense.fused[0]["qkv"]
    assert q.dense and k.dense and v.dense and q.lora_a is None  # the adapter is merged into the copy
    start, row = stacked.data_ptr(), stacked.stride(0) * stacked.element_size()
    assert [w.data.data_ptr() for w in (q, k, v)] == [start, start + 64 * row, start + 96 * row]  # rows of the copy
    down = dense.fused[1]["down"][0]
    assert down.data.data_ptr() == dense.layers[1]["down"].weight.data_ptr()
    decodes_like_the_module_step(model, plain, dense, steps=4)


def test_bitsandbytes_cpu_layout_is_refused():
    """An NF4 weight bitsandbytes has repacked for its CPU kernel (its eval forward on an AVX512-BF16 CPU does)
    is not read as if it were the standard layout."""
    from miniverl.engine.rollout.decode_projection import Weight

    layer = tiny_model(nf4=True).model.layers[0].self_attn.q_proj
    assert Weight.of(layer).nested
    layer.weight.quant_state.packing_format_for_cpu = True
    with pytest.raises(ValueError, match="packing_format_for_cpu"):
        Weight.of(layer)
