"""The decode step through the Triton kernels, for an NF4 student with LoRA: `StaticDecoder(kernels=True)`.

Per layer, instead of the module-by-module step (`StaticDecoder._layers`):
- q, k and v: `nf4_matvec` each, the input RMSNorm and the LoRA adapter fused in;
- q_norm, k_norm and the rotary embedding as the module step computes them;
- the new key and value written at each slot's position, then `decode_attention`
  over the static cache (no mask tensor);
- o_proj with its LoRA and the residual add fused; gate and up with the
  post-attention RMSNorm and LoRA fused; down_proj with LoRA and the residual.

Opt-in and not yet used by any recipe: its correctness is tested against the
module step (tests/unit/rollout/test_fused_step.py, Triton's interpreter on
the CPU); its speed is to be measured on a GPU before the engine chooses it.
Only NF4 bases with one plain LoRA adapter (or none) are covered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miniverl.engine.rollout.decode_attention import decode_attention
from miniverl.engine.rollout.nf4_matvec import QUANT_BLOCK, nf4_matvec


class _NF4Projection:
    def __init__(self, base: torch.nn.Module, a: torch.Tensor | None, b: torch.Tensor | None):
        state = getattr(base.weight, "quant_state", None)
        if state is None or state.quant_type != "nf4" or state.blocksize != QUANT_BLOCK or base.bias is not None:
            raise ValueError(f"{type(base).__name__} is not a bias-free NF4 layer with {QUANT_BLOCK}-element blocks")
        self.packed, self.state = base.weight, state
        # B arrives scaled by the adapter's alpha / r (cuda_graph._lora_parts).
        self.lora = None if a is None else (a.contiguous(), b.contiguous(), 1.0)

    def __call__(self, x: torch.Tensor, norm: torch.nn.Module | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        return nf4_matvec(x, self.packed, self.state, lora=self.lora, residual=residual,
                          norm_weight=None if norm is None else norm.weight,
                          eps=1e-6 if norm is None else norm.variance_epsilon)


def plan_layers(body: torch.nn.Module, dtype: torch.dtype, lora_parts) -> list[dict[str, _NF4Projection]]:
    """Each layer's seven projections as fused NF4 kernels; ValueError for a model they do not cover."""
    layers = []
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        modules = {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": attn.o_proj,
                   "gate": mlp.gate_proj, "up": mlp.up_proj, "down": mlp.down_proj}
        layers.append({name: _NF4Projection(*lora_parts(module, dtype)) for name, module in modules.items()})
    return layers


def decode_step(decoder, fused: list[dict[str, _NF4Projection]]) -> torch.Tensor:
    """One token per slot at its own position through the kernels; the logits (slots, vocab)."""
    tokens_S, positions_S = decoder.inputs[0], decoder.inputs[1]
    S, D, nq, nk = decoder.slots, decoder.head_dim, decoder.heads, decoder.kv_heads
    h = decoder.body.embed_tokens(tokens_S)
    cos, sin = decoder.body.rotary_emb(h, positions_S[None])
    cos, sin = cos[0, :, None], (sin[0] * decoder.rot_sign)[:, None]
    for index, (p, f) in enumerate(zip(decoder.layers, fused)):
        q, k, v = (f[name](h, p["input_norm"]) for name in ("q", "k", "v"))
        qk = F.rms_norm(torch.cat((q, k), dim=-1).view(S, nq + nk, D), (D,), None, p["qk_eps"]) * p["qk_weight"]
        qk = torch.addcmul(qk * cos, qk.roll(D // 2, dims=-1), sin)
        decoder.k_cache[index][decoder.slot_index, :, positions_S] = qk[:, nq:]
        decoder.v_cache[index][decoder.slot_index, :, positions_S] = v.view(S, nk, D)
        attended = decode_attention(qk[:, :nq], decoder.k_cache[index], decoder.v_cache[index], positions_S)
        h = f["o"](attended.reshape(S, nq * D), residual=h)
        gate, up = f["gate"](h, p["post_norm"]), f["up"](h, p["post_norm"])
        h = f["down"](p["act"](gate) * up, residual=h)
    return decoder.lm_head(F.rms_norm(h, decoder.body.norm.weight.shape, decoder.body.norm.weight,
                                      decoder.body.norm.variance_epsilon))
