"""Rollouts near the memory-bandwidth limit: a slot-based decoder with a CUDA-graph step.

Plain decoding launches every kernel of every layer from Python at each
token; for a small model that launch time, not reading the weights, is the
step time. Here the per-token step over all slots is captured once as a CUDA
graph and replayed, so a step costs the GPU time of its kernels alone.

A graph needs fixed shapes and fixed addresses, so the decoder keeps
- a static KV cache, (layers, slots, kv_heads, max_len, head_dim), and
- one static input buffer: a token id and a position per slot, written in
  place before each replay.
Each slot holds one trajectory at its own position. The step writes the new
token's key and value at (slot, position) and attends over the slot's whole
cache row with a mask `key_index <= position`, so slots never need to agree on
length. A trajectory that calls the tool keeps its slot: the tool response is
fed one forced token per step, exactly as in the plain loop, while the other
slots keep sampling. A finished trajectory frees its slot, and the next
prompt is prefilled into it (one eager forward over the prompts admitted
together, writing their keys and values into their slots).

The forward is written here over the Hugging Face Qwen3 modules, and a step
is only as fast as its kernel count, so it takes fewer kernels than
`model(...)` while computing the same function:
- each projection's base layer is called as its module (so bitsandbytes NF4
  `Linear4bit` applies), and the peft LoRA adapter is applied from the
  adapter's own weights and scaling, the A matrices of projections that share
  an input stacked into one matmul (`_Proj`); unquantized base weights are
  stacked with them into one weight per input when the copy fits;
- RMSNorm is `torch.nn.functional.rms_norm` (one fused kernel), q_norm and
  k_norm run as one call over the adjacent q and k heads;
- rotary embedding uses the model's own `rotary_emb` for cos/sin, once a step.
The tests hold this against a full forward pass of the peft model.

Sampling and turn bookkeeping are the plain loop's (`select_next`, `ToolLoop`),
so results are the same `Episode` objects. Off CUDA, or for a model this
forward does not cover, `run_episodes_fast` runs the plain loop.
"""

from __future__ import annotations

import logging
from collections import deque

import torch
import torch.nn.functional as F

from miniverl.engine.models.loading import base_model
from miniverl.engine.rollout.loop import Budget, Episode, SamplingPolicy, ToolLoop, select_next
from miniverl.engine.rollout.plain import run_episodes_plain
from miniverl.engine.tasks.base import Task, TaskItem

log = logging.getLogger(__name__)

CACHE_LEN_MULTIPLE = 64  # the attention mask's last dim stays aligned for the fused SDPA kernels


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the static decoder cannot run this model, or None when it can."""
    causal = base_model(model)
    config = causal.config
    if getattr(config, "model_type", None) != "qwen3":
        return f"model_type {getattr(config, 'model_type', None)!r} (the static decoder covers qwen3)"
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in getattr(config, "layer_types", [])):
        return "sliding-window attention layers"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope_type {rope.get('rope_type')!r} (only the default rotary embedding is position-static)"
    return None


def check_dropout_off(model: torch.nn.Module) -> None:
    """A replayed graph would freeze one dropout mask; decoding must not use dropout at all."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.training and module.p > 0:
            raise ValueError(f"{name} is an active dropout (p={module.p}); call model.eval() before decoding")


def _rms(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


class _Unsupported(Exception):
    """A projection the fused path does not cover; it is then called as its module."""


def _lora_parts(module: torch.nn.Module, dtype: torch.dtype):
    """(base layer, A, B * scaling) of a peft LoRA linear with one plain adapter active; A, B None without LoRA."""
    if not hasattr(module, "lora_A"):
        return module, None, None
    active = [a for a in module.active_adapters if a in module.lora_A]
    if module.merged or module.disable_adapters or not active:
        return module.base_layer, None, None  # peft's forward is then the base layer alone
    name = active[0]
    if len(active) > 1 or name in getattr(module, "lora_variant", {}) or module.use_dora.get(name, False) \
            or module.lora_B[name].bias is not None:
        raise _Unsupported(name)
    a, b = module.lora_A[name].weight, module.lora_B[name].weight
    return module.base_layer, a.to(dtype), (b.float() * module.scaling[name]).to(dtype)


def _dense_weight(base: torch.nn.Module, dtype: torch.dtype, dequantize: bool) -> torch.Tensor | None:
    """A bias-free base layer's weight as a dense [out, in] matrix: an nn.Linear's own, or with `dequantize` an
    NF4 layer's, dequantized as bitsandbytes' matmul dequantizes it for more than one row (the same weights it
    multiplies by); None for anything else."""
    if getattr(base, "bias", None) is not None:
        return None
    if type(base) is torch.nn.Linear:
        return base.weight
    state = getattr(base.weight, "quant_state", None)
    if dequantize and state is not None:
        import bitsandbytes.functional as bnb_functional

        return bnb_functional.dequantize_4bit(base.weight.data, state).to(dtype)
    return None


def _merged(weight: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """weight + scaling * B @ A of the module's one active adapter, summed in float32, rounded once to the
    weight's dtype (as peft's merge computes it): the adapter's function at the compute dtype's rounding."""
    name = next(a for a in module.active_adapters if a in module.lora_A)
    a, b = module.lora_A[name].weight.float(), module.lora_B[name].weight.float()
    return (weight.float() + (b * module.scaling[name]) @ a).to(weight.dtype)


class _Proj:
    """Projections of one input (q/k/v, gate/up, or one linear), each base layer plus its LoRA adapter.

    The adapters' A matrices are stacked into one matmul, and each B (scaled)
    is added to its base output by one `addmm`: 1 + 2n kernels for n LoRA
    linears instead of peft's 7 per linear. When the bases are unquantized (or
    NF4 with `dequantize`: rollout.dense_copy) and the copy fits (`fuse_base`),
    base weights and A are stacked into one weight, and the group is 2 kernels:
    one matmul, then `addmm` with a block-diagonal B. The dense copy of NF4
    bases goes further: each adapter is merged into its copy (W + scaling B A,
    rounded once), so the group is one matmul and the kernel step reads no
    adapter (`merged`); the rollout's adapter is fixed for the stage.
    LoRA runs in the compute dtype here (peft runs it in float32): a
    difference at the compute dtype's rounding. The adapter is read once, at
    construction: build a new decoder after the adapter changes.
    """

    def __init__(self, modules: list[torch.nn.Module], dtype: torch.dtype, fuse_base: bool, dequantize: bool = False):
        self.modules, self.weight, self.a_t, self.b_ts, self.dense_rows = modules, None, None, [], {}
        try:
            parts = [_lora_parts(m, dtype) for m in modules]
        except _Unsupported:
            self.bases = None  # call each module as it is
            return
        self.bases = [base for base, _, _ in parts]
        self.widths = [base.out_features for base in self.bases]
        self.out = sum(self.widths)
        adapters = [(i, a, b) for i, (_, a, b) in enumerate(parts) if a is not None]
        a_cat = torch.cat([a for _, a, _ in adapters]) if adapters else None  # (total rank, in)
        self.merged = False
        if fuse_base and (len(modules) > 1 or adapters):
            dense = [_dense_weight(b, dtype, dequantize) for b in self.bases]
            if all(w is not None for w in dense):
                if dequantize:  # the dense copy: each adapter merged into its own copy of the weights
                    dense = [w if a is None else _merged(w, m) for w, m, (_, a, _) in zip(dense, modules, parts)]
                    self.merged = True
                self.weight = torch.cat(dense + ([a_cat] if adapters and not self.merged else []))
                starts = [sum(self.widths[:i]) for i in range(len(modules))]
                # Each module's rows of the stacked copy (views): what the kernel step reads of it.
                self.dense_rows = {id(m): self.weight[r:r + w] for m, r, w in zip(modules, starts, self.widths)}
            del dense  # the dequantized matrices: only their stacked copy stays
        if not adapters or self.merged:
            return
        if self.weight is not None:  # one block-diagonal B over the stacked output
            b_bd = torch.zeros(self.out, a_cat.shape[0], dtype=dtype, device=a_cat.device)
            rank_at = 0
            for i, a, b in adapters:
                row = sum(self.widths[:i])
                b_bd[row:row + self.widths[i], rank_at:rank_at + a.shape[0]] = b
                rank_at += a.shape[0]
            self.b_ts = [(None, 0, rank_at, b_bd.t())]
            return
        self.a_t = a_cat.t()  # (in, total rank)
        rank_at = 0
        for i, a, b in adapters:
            self.b_ts.append((i, rank_at, rank_at + a.shape[0], b.t()))
            rank_at += a.shape[0]

    def __call__(self, x_MK: torch.Tensor) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """(the stacked output when there is one, each projection's output)."""
        if self.bases is None:
            return None, [m(x_MK) for m in self.modules]
        if self.weight is not None:
            y = F.linear(x_MK, self.weight)  # (M, out), then (M, total rank) of x A^T when there are adapters
            if self.b_ts:
                y = torch.addmm(y[:, :self.out], y[:, self.out:], self.b_ts[0][3])
            return y, list(y.split(self.widths, dim=-1))
        h = x_MK @ self.a_t if self.a_t is not None else None  # (M, total rank)
        outs = [base(x_MK) for base in self.bases]
        for i, lo, hi, b_t in self.b_ts:
            outs[i] = torch.addmm(outs[i], h[:, lo:hi], b_t)
        return None, outs


class StaticDecoder:
    """A fixed set of slots over a static KV cache, with the decode step as a CUDA graph.

    `prefill(slots, prompts)` and `step(tokens, positions)` both leave each
    slot's next-token logits in `self.logits` (slots, vocab).
    """

    def __init__(self, model: torch.nn.Module, slots: int, max_len: int, use_graph: bool, fuse_weights: bool = True,
                 kernels: bool | None = False, dense_copy: bool = False):
        causal = base_model(model)
        self.body, self.lm_head, config = causal.model, causal.lm_head, causal.config
        embed = self.body.embed_tokens.weight
        self.device, self.dtype = embed.device, embed.dtype
        self.slots = slots
        self.max_len = -(-max_len // CACHE_LEN_MULTIPLE) * CACHE_LEN_MULTIPLE
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        shape = (config.num_hidden_layers, slots, self.kv_heads, self.max_len, self.head_dim)
        # Zeros, not empty: masked keys still meet their values (0 * NaN would poison a row).
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # dense_copy (rollout.dense_copy, sized by the memory plan): NF4 bases dequantized into the stacked copy.
        self.dense_copy = dense_copy
        self.fused_weights = dense_copy or (fuse_weights and self._stacked_copy_fits())
        self.layers = [self._plan(layer) for layer in self.body.layers]
        half = self.head_dim // 2
        self.rot_sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(self.device, self.dtype)
        # kernels: the one-token step through the Triton kernels (fused_step); None: where it is faster.
        self.fused, self.kernels_auto = None, kernels is None
        if kernels or (kernels is None and self.device.type == "cuda"):
            self.fused = self._plan_kernels(slots, required=bool(kernels))
        self.inputs = torch.zeros(2, slots, dtype=torch.long, device=self.device)  # row 0 token ids, row 1 positions
        # Their host side, pinned on CUDA: each step's copy is queued without waiting; the buffer is written
        # again only once that copy is done (`copied`; a step that sampled has waited for it already).
        on_cuda = self.device.type == "cuda"
        self.host_inputs = torch.zeros(2, slots, dtype=torch.long, pin_memory=on_cuda)
        self.copied = torch.cuda.Event() if on_cuda else None
        self.slot_index = torch.arange(slots, device=self.device)
        self.key_index = torch.arange(self.max_len, device=self.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits = torch.zeros(slots, config.vocab_size, dtype=self.dtype, device=self.device)
        self.mode = "eager"
        if use_graph:
            self._capture()

    def _plan_kernels(self, slots: int, required: bool) -> list[dict] | None:
        """The kernel step's weights, or None (with the reason logged) where `auto` keeps the module step."""
        try:
            from miniverl.engine.rollout.fused_step import auto_choice, plan_layers, rotary_tables

            reason = None if required else auto_choice(self.body, slots, self.dense_copy)
            # With the dense copy the kernels read its rows (views, no further copy), not the NF4 bases.
            rows = {key: (view, p[name].merged) for p in self.layers for name in ("qkv", "o", "gate_up", "down")
                    for key, view in p[name].dense_rows.items()} if self.dense_copy else {}
            fused = None if reason is not None else plan_layers(self.body, self.dtype, _lora_parts,
                                                                 lambda module: rows.get(id(module)))
        except (ImportError, ValueError) as exc:  # no Triton, or a model the kernels do not cover
            if required:
                raise
            reason = f"{type(exc).__name__}: {exc}"
        if reason is not None:
            log.info("decode step: module by module (%s)", reason)
            return None
        self.rotary = rotary_tables(self.body, self.max_len, self.rot_sign)
        return fused

    def _stacked_copy_fits(self) -> bool:
        """Stack base weights only if unquantized and the copy takes under a quarter of free memory."""
        mlp, attn = self.body.layers[0].mlp, self.body.layers[0].self_attn
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        bases = [getattr(m, "base_layer", m) for m in linears]
        if any(type(b) is not torch.nn.Linear for b in bases):
            return False
        if self.device.type != "cuda":
            return True
        copy = len(self.body.layers) * sum(b.weight.numel() for b in bases) * self.dtype.itemsize
        return copy < torch.cuda.mem_get_info(self.device)[0] / 4

    def _plan(self, layer) -> dict:
        attn, mlp, dtype, fuse, dense = layer.self_attn, layer.mlp, self.dtype, self.fused_weights, self.dense_copy
        assert attn.q_norm.variance_epsilon == attn.k_norm.variance_epsilon
        return {
            "input_norm": layer.input_layernorm, "post_norm": layer.post_attention_layernorm,
            "qkv": _Proj([attn.q_proj, attn.k_proj, attn.v_proj], dtype, fuse, dense),
            "o": _Proj([attn.o_proj], dtype, fuse, dense),
            "gate_up": _Proj([mlp.gate_proj, mlp.up_proj], dtype, fuse, dense),
            "down": _Proj([mlp.down_proj], dtype, fuse, dense),
            # q_norm then k_norm weights, one row per head: both norms become one rms_norm and one multiply.
            "qk_weight": torch.cat([attn.q_norm.weight.expand(self.heads, -1), attn.k_norm.weight.expand(self.kv_heads, -1)]),
            "qk_eps": attn.q_norm.variance_epsilon, "act": mlp.act_fn,
        }

    # ------------------------------------------------------------------ forward

    def _layers(self, h_MH: torch.Tensor, positions_M: torch.Tensor, attend) -> torch.Tensor:
        """The decoder stack over M tokens (flattened); `attend(layer, q, k, v)` stores k/v, returns (M, heads*D)."""
        M, D, nq, nk = h_MH.shape[0], self.head_dim, self.heads, self.kv_heads
        cos, sin = self.body.rotary_emb(h_MH, positions_M[None])  # (1, M, D) each
        # rotate_half(x) = (-x2, x1) = roll(x, D/2) * (-1.., +1..): the sign goes into sin once per call.
        cos, sin = cos[0, :, None], (sin[0] * self.rot_sign)[:, None]  # (M, 1, D)
        for index, p in enumerate(self.layers):
            x = _rms(p["input_norm"], h_MH)
            joined, (q, k, v) = p["qkv"](x)
            # q_norm and k_norm as Qwen3RMSNorm computes them (normalize, round, then weight), in one call
            # over adjacent heads; over the stacked output the v heads are normalized too, and dropped.
            heads = joined.view(M, -1, D) if joined is not None else torch.cat((q, k), dim=-1).view(M, nq + nk, D)
            qk = F.rms_norm(heads, (D,), None, p["qk_eps"])[:, :nq + nk] * p["qk_weight"]
            qk = torch.addcmul(qk * cos, qk.roll(D // 2, dims=-1), sin)  # rotary embedding
            h_MH = h_MH + p["o"](attend(index, qk[:, :nq], qk[:, nq:], v.view(M, nk, D)))[1][0]
            _, (gate, up) = p["gate_up"](_rms(p["post_norm"], h_MH))
            h_MH = h_MH + p["down"](p["act"](gate) * up)[1][0]
        return _rms(self.body.norm, h_MH)

    def _decode(self) -> torch.Tensor:
        """One token per slot at its own position; static shapes only, so it can be captured."""
        if self.fused is not None:
            from miniverl.engine.rollout.fused_step import decode_step

            return decode_step(self, self.fused)
        tokens_S, positions_S = self.inputs[0], self.inputs[1]
        S, group, D = self.slots, self.heads // self.kv_heads, self.head_dim
        visible_SL = self.key_index[None, :] <= positions_S[:, None]
        bias = torch.zeros(S, 1, 1, self.max_len, dtype=self.dtype, device=self.device)
        bias = bias.masked_fill(~visible_SL[:, None, None, :], float("-inf"))  # (S, 1, 1, L)

        def attend(layer: int, q_SND, k_SKD, v_SKD):
            self.k_cache[layer][self.slot_index, :, positions_S] = k_SKD
            self.v_cache[layer][self.slot_index, :, positions_S] = v_SKD
            # Grouped-query attention without copying the cache: with one query
            # token, the `group` query heads that share a kv head act as `group`
            # query rows against that head's keys (head h uses kv head h // group).
            q = q_SND.reshape(S, self.kv_heads, group, D)
            out = F.scaled_dot_product_attention(q, self.k_cache[layer], self.v_cache[layer], attn_mask=bias)
            return out.reshape(S, self.heads * D)

        return self.lm_head(self._layers(self.body.embed_tokens(tokens_S), positions_S, attend))

    @torch.no_grad()
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> None:
        """Write fresh prompts into the given slots; their last-token logits land in `self.logits`."""
        n, T, D = len(prompts), max(len(p) for p in prompts), self.head_dim
        # Right padding: a padded position's key is rewritten by the slot's own
        # next token before any query can see it (keys are visible up to the
        # query's position only), and causal attention keeps it out of the prompt.
        ids_NT = torch.tensor([p + [p[-1]] * (T - len(p)) for p in prompts], device=self.device)
        positions_NT = torch.arange(T, device=self.device).expand(n, T)
        slot_N1 = torch.tensor(slots, device=self.device)[:, None]
        group = self.heads // self.kv_heads

        def attend(layer: int, q_MND, k_MKD, v_MKD):
            k, v = k_MKD.view(n, T, -1, D), v_MKD.view(n, T, -1, D)
            self.k_cache[layer][slot_N1, :, positions_NT] = k
            self.v_cache[layer][slot_N1, :, positions_NT] = v
            k = k.transpose(1, 2).repeat_interleave(group, dim=1)  # (N, heads, T, D)
            v = v.transpose(1, 2).repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(q_MND.view(n, T, -1, D).transpose(1, 2), k, v, is_causal=True)
            return out.transpose(1, 2).reshape(n * T, -1)

        h_MH = self._layers(self.body.embed_tokens(ids_NT.reshape(-1)), positions_NT.reshape(-1), attend)
        last = torch.tensor([i * T + len(p) - 1 for i, p in enumerate(prompts)], device=self.device)
        self.logits[slot_N1[:, 0]] = self.lm_head(h_MH[last])

    @torch.no_grad()
    def step(self, tokens: list[int], positions: list[int]) -> None:
        """Feed one token per slot (idle slots: any token at position 0)."""
        if self.copied is not None:
            self.copied.synchronize()
        staged = self.host_inputs.numpy()
        staged[0], staged[1] = tokens, positions
        self.inputs.copy_(self.host_inputs, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits.copy_(self._decode())

    @torch.no_grad()
    def _capture(self) -> None:
        # Warm up on a side stream (lazy inits, cuBLAS handles, autotuning), then capture.
        # Warm-up writes keys at position 0 of idle slots: harmless, prefill rewrites them.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            try:
                for _ in range(2):
                    self._decode()
            except Exception as exc:  # noqa: BLE001 - a kernel that fails to build here: auto takes the module step
                if self.fused is None or not self.kernels_auto:
                    raise
                log.warning("decode kernels failed (%s: %s); decoding module by module", type(exc).__name__, exc)
                self.fused = None
                for _ in range(2):
                    self._decode()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = self._decode()
        except Exception as exc:  # noqa: BLE001 - any capture failure means: run the same forward eagerly
            torch.cuda.synchronize(self.device)
            log.warning("CUDA graph capture failed (%s: %s); decoding eagerly", type(exc).__name__, exc)
            return
        self.graph, self.logits, self.mode = graph, out, "graph"


@torch.no_grad()
def run_slots(decoder: StaticDecoder, tool_loop: ToolLoop, episodes: list[Episode], policy: SamplingPolicy,
              generator: torch.Generator | None, vocab_limit: int, on_done=None) -> list[Episode]:
    """Decode every episode to completion, refilling slots from the queue as episodes finish."""
    queue = deque(range(len(episodes)))
    owner: list[int | None] = [None] * decoder.slots  # episode index held by each slot
    position = [0] * decoder.slots  # where the slot's next fed token goes
    done = 0
    while True:
        free = [s for s in range(decoder.slots) if owner[s] is None][:len(queue)]
        if free:
            for s in free:
                owner[s] = queue.popleft()
                e = episodes[owner[s]]
                position[s] = len(e.pending)
            decoder.prefill(free, [[tool_loop.feed_forced(episodes[owner[s]]) for _ in range(position[s])] for s in free])
        live = [s for s in range(decoder.slots) if owner[s] is not None]
        if not live:
            return episodes
        tokens = [0] * decoder.slots
        sample = [s for s in live if not episodes[owner[s]].pending]
        if sample:
            logits = decoder.logits if len(sample) == decoder.slots else decoder.logits[sample]
            next_tokens, logprobs = select_next(logits[:, :vocab_limit], policy, generator)
            # One device-to-host read a step, not two: token ids are exact in float64, so are float32 log-probs.
            picked, picked_logprobs = torch.stack((next_tokens.double(), logprobs.double())).tolist()
            for s, token, logprob in zip(sample, picked, picked_logprobs):
                token = int(token)
                tokens[s] = token
                tool_loop.feed_sampled(episodes[owner[s]], token, logprob)
        for s in live:
            e = episodes[owner[s]]
            if e.finished:
                owner[s], position[s] = None, 0
                done += 1
            elif s not in sample:
                tokens[s] = tool_loop.feed_forced(e)
        if on_done is not None and len(live) != sum(o is not None for o in owner):
            on_done(done)
        if all(o is None for o in owner):
            continue  # nothing to step; admit the next prompts (or return)
        decoder.step(tokens, position)
        position = [p + 1 if owner[s] is not None else 0 for s, p in enumerate(position)]


def decode_episodes(model, tool_loop: ToolLoop, tasks: list[TaskItem], policy: SamplingPolicy,
                    generator: torch.Generator | None, vocab_limit: int, batch_size: int,
                    use_graph: bool, on_batch=None, fuse_weights: bool = True,
                    kernels: bool | None = False, dense_copy: bool = False) -> tuple[list[Episode], StaticDecoder]:
    """The slot engine, with or without the CUDA graph (without: the same forward, run eagerly); `kernels`:
    the Triton decode step (True), the module step (False), or whichever is faster for the model (None);
    `dense_copy`: an NF4 model's bases dequantized into one stacked copy for the module step."""
    check_dropout_off(model)
    episodes = [tool_loop.start(task) for task in tasks]
    if not episodes:
        return [], None
    # A slot holds at most max_total_tokens fed tokens (the last sampled token is never fed),
    # or the prompt alone when the prompt is longer than that.
    max_len = max(tool_loop.budget.max_total_tokens, max(len(e.pending) for e in episodes))
    decoder = StaticDecoder(model, min(batch_size, len(episodes)), max_len, use_graph, fuse_weights, kernels,
                            dense_copy)
    return run_slots(decoder, tool_loop, episodes, policy, generator, vocab_limit, on_batch), decoder


def run_episodes_fast(model, tokenizer, task: Task, tasks: list[TaskItem], policy: SamplingPolicy, budget: Budget,
                      generator: torch.Generator | None, vocab_limit: int, device: str, batch_size: int,
                      on_batch=None, kernels: bool | None = None, dense_copy: bool = False) -> list[Episode]:
    """`run_episodes` with the CUDA-graph engine on CUDA, the plain loop elsewhere; `kernels` and `dense_copy`
    as in `decode_episodes` (kernels None: the Triton decode step where it is faster)."""
    reason = unsupported_reason(model) if device == "cuda" else "not on CUDA"
    if reason is not None:
        if device == "cuda":
            log.warning("CUDA-graph rollout engine not used: %s; running the plain loop", reason)
        return run_episodes_plain(model, tokenizer, task, tasks, policy, budget, generator, vocab_limit, device,
                                  batch_size, on_batch)
    episodes, _ = decode_episodes(model, ToolLoop(tokenizer, task, budget), tasks, policy, generator, vocab_limit,
                                  batch_size, use_graph=True, on_batch=on_batch, kernels=kernels,
                                  dense_copy=dense_copy)
    return episodes
