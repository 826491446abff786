"""The decode step through the Triton kernels: `StaticDecoder(kernels=True)`, six launches per layer.

Per layer, instead of the module-by-module step (`StaticDecoder._layers`, ~29 GPU operations):
1. `project(h, [q, k, v], norm=input_layernorm)`: the input RMSNorm, the three
   projections and their LoRA adapters into one [S, (H + 2 Hkv) D] row;
2-3. `attend_new_token`: the split-key attention, whose programs take q_norm,
   k_norm and the rotary embedding from that row and append the new key and
   value to the static cache themselves, then the splits combined;
4. `project(attended, [o], residual=h)`;
5. `project(h, [gate, up], norm=post_attention_layernorm, silu_mul=True)`;
6. `project(act, [down], residual=h)`.
Each projection's norm(x) @ A.T runs as the first programs of its own launch
(`project(lora_sync=...)`), not as a launch before it.
Then the final norm and the LM head (one cuBLAS GEMV) as the module step
runs them. The bases are NF4 (bitsandbytes, read in place) or bf16/fp16/fp32
linears, each with one plain LoRA adapter or none (all seven alike).

Where it is faster (`AUTO_MAX_SLOTS`, from the replayed step on one H200 at
Qwen3-0.6B's shape with LoRA r16, benchmarks/results/decode_step_sweep_h200.md,
its final table): NF4 1.60 ms against the module step's 3.57 at one slot, 3.98
against 5.10 at eight, but 14.06 against 6.57 at 32; bf16 1.19 against 2.56 at
one slot, 2.37 against 2.78 at eight (dense weights past four rows take swapped
tensor-core tiles, `tile_config`). With `rollout.dense_copy` (the adapter merged
into the copy) 0.82 against 2.11 at one slot and 1.77 against 2.15 at eight, so
`auto` counts the copy as dense weights. Dense weights were faster at 32 too
(2.50 against 3.19), but slot counts between 8 and 32 were not measured, so
`auto` stops at eight for both kinds. The Triton launches use
programmatic dependent launch where the GPU has it (compute capability 9 on).
With the six launches a layer (benchmarks/results/decode_step_sweep_h200.md,
session 8): bf16 1.14-1.15 ms at one slot, 2.30-2.32 at eight; NF4 1.51-1.52
and 3.81-3.83, against 1.16-1.17, 2.36, 1.59 and 3.96 for the eleven before it
in the same runs. Session 9 (the same file): the split-key programs read the
older keys before PDL's wait, B's tiles and the residual are read early, gate
and up share a loop on broadcast tiles, and o_proj's and down_proj's K is split
over programs (`SPLIT_COUNTERS` counters a launch): bf16 1.01 / 2.00 ms at one /
eight slots, NF4 1.33 / 3.12, the dense copy 0.72 / 1.69, against 1.16 / 2.31,
1.52 / 3.84 and 0.82 / 1.76 for session 8's step in the same run. Session 10: at one
slot the split-key attention takes splits of 16 keys (`decode_attention.split_keys`) and
NF4 gate/up 4-row tiles: bf16 0.92 ms, NF4 1.17, the dense copy 0.68 at one slot
(against 1.00, 1.32 and 0.72 in the same run; over 704 keys bf16 0.98 against 1.05),
eight slots unchanged; then x @ A.T's workers one chunk of K each: 0.88 and 1.13.
Forwarding x @ A.T from each launch to the next, so that no launch computes its own,
was measured slower (bf16 1.15 / 3.48 ms) and not kept. Session 12: combining the
attention's splits inside the split-key launch (`attend_new_token(counters=...)`)
was slower too (bf16 0.928 against 0.897 ms at one slot, NF4 1.188 against 1.135),
so the step keeps the combine as a launch of its own. Session 15 (on an H100): NF4 at
eight slots 2.69 ms against 3.08 with every row's broadcast sums at once (`tile_config`);
launches asking L2 for later launches' weights (Hopper's bulk prefetch) were slower at
every schedule tried (bf16 1.03-1.25 ms against 0.99 at one slot) and were not kept. Sessions 17-18
(H100): bf16 rounded by the GPU's conversion, and with an adapter at 5-8 rows o_proj and down_proj sum
every row at once while gate/up split K over 2 programs: bf16 0.965 ms at one slot, 1.70-1.73 at 5-8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miniverl.engine.rollout.decode_attention import attend_new_token
from miniverl.engine.rollout.decode_projection import SPLIT_COUNTERS, Weight, project, stack_lora_a


AUTO_MAX_SLOTS = {"nf4": 8, "dense": 8}  # the most slots at which `rollout.engine: auto` takes the kernel step


def auto_choice(body: torch.nn.Module, slots: int, dense_copy: bool = False) -> str | None:
    """Why `auto` keeps the module step for this model and slot count, or None when the kernel step is faster.
    Read off the first projection alone, before `plan_layers` visits every weight; with `dense_copy` the
    kernels read the decoder's dense copy of the weights, whatever the model holds."""
    o_proj = body.layers[0].self_attn.o_proj
    quantized = getattr(getattr(o_proj, "base_layer", o_proj).weight, "quant_state", None) is not None
    kind = "nf4" if quantized and not dense_copy else "dense"
    if slots > AUTO_MAX_SLOTS[kind]:
        return f"{slots} slots of {kind} weights (the kernel step is faster up to {AUTO_MAX_SLOTS[kind]})"
    return None


def plan_layers(body: torch.nn.Module, dtype: torch.dtype, lora_parts, dense_of=None) -> list[dict]:
    """Each layer's weights as the kernels read them; ValueError for a model they do not cover.

    `dense_of(module)`: (the dense [out, in] matrix to read for a projection instead of its base layer's weight,
    whether its adapter is merged into it) for the decoder's dense copy of NF4 weights, or None to read the
    base layer's own.
    """
    def weight_of(module: torch.nn.Module) -> Weight:
        base, a, b = lora_parts(module, dtype)
        dense = None if dense_of is None else dense_of(module)
        if dense is None:
            return Weight.of(base, a, b)
        matrix, merged = dense
        if merged or a is None:
            return Weight(matrix.shape[0], matrix.shape[1], matrix)
        return Weight(matrix.shape[0], matrix.shape[1], matrix, lora_a=a.contiguous(), lora_b=b.contiguous())

    layers = []
    device = body.embed_tokens.weight.device
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.q_norm.variance_epsilon != attn.k_norm.variance_epsilon:
            raise ValueError("q_norm and k_norm differ in eps")
        weights = {name: weight_of(module) for name, module in (
            ("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj), ("o", attn.o_proj),
            ("gate", mlp.gate_proj), ("up", mlp.up_proj), ("down", mlp.down_proj))}
        kinds = {(w.dense, w.nested, w.lora_a is None, None if w.lora_a is None else w.lora_a.shape[0])
                 for w in weights.values()}
        if len(kinds) != 1:
            raise ValueError("the decode kernels need the seven projections alike (one kind, one LoRA rank)")
        codes = [w for w in weights.values() if not w.dense]
        if codes and not all(torch.equal(w.code, codes[0].code) and torch.equal(w.code2, codes[0].code2)
                             for w in codes):
            raise ValueError("the NF4 weights of a layer must share bitsandbytes' code tables")
        groups = {"qkv": [weights["q"], weights["k"], weights["v"]], "o": [weights["o"]],
                  "gate_up": [weights["gate"], weights["up"]], "down": [weights["down"]]}
        layers.append({
            **groups, **{f"{name}_a": stack_lora_a(group) for name, group in groups.items()},
            # each launch's counters for x @ A.T computed inside it (`project(lora_sync=...)`), left zeroed
            **{f"{name}_sync": torch.zeros(2, dtype=torch.int32, device=device) for name in groups},
            # and for K split across programs (`project(split_k=...)`), one a tile
            **{f"{name}_split": torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device) for name in groups},
            "input_norm": layer.input_layernorm, "post_norm": layer.post_attention_layernorm,
            "q_norm": attn.q_norm.weight, "k_norm": attn.k_norm.weight, "qk_eps": attn.q_norm.variance_epsilon,
        })
    return layers


def rotary_tables(body: torch.nn.Module, max_len: int, rot_sign: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin [max_len, D] as the model's rotary embedding gives them at positions 0..max_len-1."""
    embed = body.embed_tokens.weight
    positions = torch.arange(max_len, device=embed.device)[None]
    cos, sin = body.rotary_emb(embed[:1, None].expand(1, max_len, -1), positions)
    return cos[0].contiguous(), (sin[0] * rot_sign).contiguous()


def decode_step(decoder, fused: list[dict]) -> torch.Tensor:
    """One token per slot at its own position through the kernels; the logits (slots, vocab)."""
    tokens_S, positions_S = decoder.inputs[0], decoder.inputs[1]
    S = decoder.slots
    cos, sin = decoder.rotary
    h = decoder.body.embed_tokens(tokens_S)
    for index, f in enumerate(fused):
        norm = f["input_norm"]
        qkv = project(h, f["qkv"], norm_weight=norm.weight, eps=norm.variance_epsilon, lora_a_stacked=f["qkv_a"],
                      lora_sync=f["qkv_sync"], split_counters=f["qkv_split"])
        # no `counters`: the separate combine launch measured faster than folding it into the split-key launch
        # (benchmarks/results/decode_step_sweep_h200.md, session 12)
        attended = attend_new_token(qkv, f["q_norm"], f["k_norm"], f["qk_eps"], cos, sin, positions_S,
                                    decoder.k_cache[index], decoder.v_cache[index])
        h = project(attended.view(S, -1), f["o"], residual=h, lora_a_stacked=f["o_a"], lora_sync=f["o_sync"],
                    split_counters=f["o_split"])
        norm = f["post_norm"]
        act = project(h, f["gate_up"], norm_weight=norm.weight, eps=norm.variance_epsilon, silu_mul=True,
                      lora_a_stacked=f["gate_up_a"], lora_sync=f["gate_up_sync"], split_counters=f["gate_up_split"])
        h = project(act, f["down"], residual=h, lora_a_stacked=f["down_a"], lora_sync=f["down_sync"],
                    split_counters=f["down_split"])
    final = decoder.body.norm
    return decoder.lm_head(F.rms_norm(h, final.weight.shape, final.weight, final.variance_epsilon))
