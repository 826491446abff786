"""The slot decoder against an independent reference: a full forward pass per token, no cache.

CPU: the slot engine's own forward, run eagerly (no graph), and the CPU
fallback of `run_episodes_fast`, on a random tiny student with a non-zero LoRA
adapter. GPU (`-m gpu`): the captured CUDA graph at the Qwen3-0.6B shape, in
float32 (exact greedy identity), bf16 and NF4 (log-probs within tolerance).

A random model almost never writes a tool call, so `ScriptedToolLoop` treats
some sampled tokens (by value and position) as a call: the turn closes and a
tool response is fed back, which exercises the paused-slot path of the engine.
"""

from __future__ import annotations

import pytest
import torch

from miniverl.engine.core.artifacts import PROVENANCE_MODEL, PROVENANCE_TOOL
from miniverl.engine.rollout.cuda_graph import decode_episodes, run_episodes_fast
from miniverl.engine.rollout.loop import Budget, SamplingPolicy, ToolLoop, select_next
from miniverl.engine.rollout.plain import run_episodes_plain
from miniverl.engine.tasks.base import ToolResult
from miniverl.engine.tasks.calculator import CalculatorTask
from miniverl.engine.tasks.protocol import tool_responses_text
from miniverl.engine.tiny.models import STUDENT_SPEC, TOKENIZER_SIZE, build_model, load_tokenizer

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GREEDY = SamplingPolicy(greedy=True)
BUDGET = Budget(max_turns=3, max_new_tokens_per_turn=12, max_total_tokens=110)
CALC = CalculatorTask()


def make_tasks(split, count, seed):
    return CALC.items(split, count, seed)


class ScriptedToolLoop(ToolLoop):
    """ToolLoop whose tool calls are triggered by token values instead of by parsing."""

    def feed_sampled(self, episode, token, logprob):
        super().feed_sampled(episode, token, logprob)
        if episode.finished or (token + len(episode.token_ids)) % 7 or len(episode.turns) >= self.budget.max_turns - 1:
            return
        self._close_turn(episode, run_tools=False)
        episode.results[-1] = (ToolResult(str(token), True),)
        response = self.tokenizer(tool_responses_text([str(token)]), add_special_tokens=False).input_ids
        if len(episode.token_ids) + len(response) >= self.budget.max_total_tokens:
            self._finish(episode, "length")
        else:
            episode.pending.extend((t, PROVENANCE_TOOL) for t in response)


def policy_logprobs(logits_RV: torch.Tensor, policy: SamplingPolicy) -> torch.Tensor:
    """Log-probs of the distribution the policy samples from (temperature, then top-p)."""
    logits_RV = logits_RV.float() / (1.0 if policy.greedy else policy.temperature)
    if not policy.greedy and policy.top_p < 1.0:
        probs = logits_RV.softmax(-1)
        sorted_probs, order = probs.sort(-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(1, order, before >= policy.top_p)
        logits_RV = logits_RV.masked_fill(drop, float("-inf"))
    return logits_RV.log_softmax(-1)


@torch.no_grad()
def full_recompute_greedy(model, tool_loop, tasks, vocab_limit, device):
    """One episode at a time; each token from a full forward over everything so far."""
    episodes = []
    for task in tasks:
        e = tool_loop.start(task)
        while not e.finished:
            if e.pending:
                tool_loop.feed_forced(e)
                continue
            logits = model(input_ids=torch.tensor([e.token_ids], device=device)).logits[:, -1, :vocab_limit]
            token, logprob = select_next(logits, GREEDY, None)
            tool_loop.feed_sampled(e, token.item(), logprob.item())
        episodes.append(e)
    return episodes


@torch.no_grad()
def recomputed_logprobs(model, episode, policy, vocab_limit, device):
    """Log-probs of the episode's sampled tokens, from one full forward over the episode."""
    ids = torch.tensor([episode.token_ids], device=device)
    logprobs_TV = policy_logprobs(model(input_ids=ids).logits[0, :-1, :vocab_limit], policy)
    where = [i for i, p in enumerate(episode.provenance) if p == PROVENANCE_MODEL]
    return logprobs_TV[[i - 1 for i in where], ids[0, where]]


def assert_same_episodes(got, want, atol):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids, f"{g.task.task_id}: tokens differ"
        assert g.provenance == w.provenance and g.turns == w.turns
        assert g.finish_reason == w.finish_reason and g.tool_results == w.tool_results
        torch.testing.assert_close(torch.tensor(g.sampling_logprobs), torch.tensor(w.sampling_logprobs), atol=atol, rtol=0)


def with_random_lora(model, seed=7):
    """A peft LoRA adapter whose B matrices are non-zero, so a forward that skipped it would differ."""
    from miniverl.engine.models.loading import attach_lora
    from miniverl.engine.core.recipe import LoraSpec

    model = attach_lora(model, LoraSpec(), seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


@pytest.fixture(scope="module")
def tiny():
    tokenizer = load_tokenizer()
    model = with_random_lora(build_model(STUDENT_SPEC, tokenizer, seed=3).eval())
    return model, tokenizer


def test_scripted_tool_loop_exercises_the_tool_path(tiny):
    model, tokenizer = tiny
    episodes = full_recompute_greedy(model, ScriptedToolLoop(tokenizer, CALC, BUDGET), make_tasks("train", 6, 1), TOKENIZER_SIZE, "cpu")
    assert any(PROVENANCE_TOOL in e.provenance for e in episodes)
    assert len({len(e.token_ids) for e in episodes}) > 1  # slots free up at different steps


@pytest.mark.parametrize("fuse_weights", [True, False])
def test_eager_slot_engine_matches_full_recompute(tiny, fuse_weights):
    model, tokenizer = tiny
    tasks = make_tasks("train", 7, 1)
    want = full_recompute_greedy(model, ScriptedToolLoop(tokenizer, CALC, BUDGET), tasks, TOKENIZER_SIZE, "cpu")
    got, decoder = decode_episodes(model, ScriptedToolLoop(tokenizer, CALC, BUDGET), tasks, GREEDY, None, TOKENIZER_SIZE,
                                   batch_size=3, use_graph=False, fuse_weights=fuse_weights)  # 3 slots, 7 tasks
    assert decoder.mode == "eager" and decoder.fused_weights == fuse_weights
    assert_same_episodes(got, want, atol=1e-4)


def test_lora_modules_the_fused_path_does_not_cover_are_called_as_modules(tiny, monkeypatch):
    """A LoRA variant (e.g. DoRA) falls back to the peft module's own forward, with the same results."""
    from miniverl.engine.rollout import cuda_graph as cuda_graph_engine

    def unsupported(module, dtype):
        raise cuda_graph_engine._Unsupported("variant")

    model, tokenizer = tiny
    tasks = make_tasks("train", 3, 1)
    want = full_recompute_greedy(model, ScriptedToolLoop(tokenizer, CALC, BUDGET), tasks, TOKENIZER_SIZE, "cpu")
    monkeypatch.setattr(cuda_graph_engine, "_lora_parts", unsupported)
    got, decoder = decode_episodes(model, ScriptedToolLoop(tokenizer, CALC, BUDGET), tasks, GREEDY, None, TOKENIZER_SIZE,
                                   batch_size=2, use_graph=False)
    assert decoder.layers[0]["qkv"].bases is None
    assert_same_episodes(got, want, atol=1e-4)


def test_cpu_fallback_is_the_plain_loop_and_matches_full_recompute(tiny):
    model, tokenizer = tiny
    tasks = make_tasks("heldout", 5, 2)
    got = run_episodes_fast(model, tokenizer, CALC, tasks, GREEDY, BUDGET, None, TOKENIZER_SIZE, "cpu", 4)
    assert_same_episodes(got, run_episodes_plain(model, tokenizer, CALC, tasks, GREEDY, BUDGET, None, TOKENIZER_SIZE, "cpu", 4), atol=0)
    want = full_recompute_greedy(model, ToolLoop(tokenizer, CALC, BUDGET), tasks, TOKENIZER_SIZE, "cpu")
    assert_same_episodes(got, want, atol=1e-4)


def test_eager_slot_engine_sampled_logprobs_match_recomputation(tiny):
    model, tokenizer = tiny
    policy = SamplingPolicy(greedy=False, temperature=0.7, top_p=0.9)
    gen = torch.Generator().manual_seed(5)
    episodes, _ = decode_episodes(model, ScriptedToolLoop(tokenizer, CALC, BUDGET), make_tasks("train", 6, 4), policy, gen,
                                  TOKENIZER_SIZE, batch_size=4, use_graph=False)
    for e in episodes:
        want = recomputed_logprobs(model, e, policy, TOKENIZER_SIZE, "cpu")
        torch.testing.assert_close(torch.tensor(e.sampling_logprobs), want, atol=1e-4, rtol=0)


# ---------------------------------------------------------------- GPU: the Qwen3-0.6B shape


def qwen3_0_6b(dtype, seed=0, layers=28):
    """Qwen3-0.6B's published shape with random weights (no hub)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, max_position_embeddings=40960,
        rms_norm_eps=1e-6, use_sliding_window=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device("cuda"):
        return Qwen3ForCausalLM(config).to(dtype).eval()


# kernels: the decode step module by module (False) or through the Triton decode kernels (True).
STEPS = pytest.mark.parametrize("kernels", [False, True], ids=["module-step", "kernel-step"])


@gpu
@needs_cuda
@STEPS
def test_gpu_graph_greedy_matches_full_recompute_float32(kernels: bool):
    tokenizer = load_tokenizer()
    model = with_random_lora(qwen3_0_6b(torch.float32))
    tasks = make_tasks("train", 5, 6)
    want = full_recompute_greedy(model, ScriptedToolLoop(tokenizer, CALC, BUDGET), tasks, TOKENIZER_SIZE, "cuda")
    got, decoder = decode_episodes(model, ScriptedToolLoop(tokenizer, CALC, BUDGET), tasks, GREEDY, None, TOKENIZER_SIZE,
                                   batch_size=2, use_graph=True, kernels=kernels)
    assert decoder.mode == "graph" and (decoder.fused is not None) == kernels
    assert_same_episodes(got, want, atol=2e-3)


def _sampled_logprob_errors(model, tokenizer, kernels: bool):
    policy = SamplingPolicy(greedy=False, temperature=1.0, top_p=1.0)
    gen = torch.Generator("cuda").manual_seed(9)
    episodes, decoder = decode_episodes(model, ScriptedToolLoop(tokenizer, CALC, BUDGET), make_tasks("train", 8, 8), policy,
                                        gen, TOKENIZER_SIZE, batch_size=4, use_graph=True, kernels=kernels)
    errors = torch.cat([(torch.tensor(e.sampling_logprobs, device="cuda") - recomputed_logprobs(model, e, policy, TOKENIZER_SIZE, "cuda")).abs()
                        for e in episodes])
    assert (decoder.fused is not None) == kernels
    return decoder.mode, errors


@gpu
@needs_cuda
@STEPS
def test_gpu_graph_bf16_sampled_logprobs_match_full_forward(kernels: bool):
    mode, errors = _sampled_logprob_errors(with_random_lora(qwen3_0_6b(torch.bfloat16)), load_tokenizer(), kernels)
    print(f"bf16: mean |dlogprob| {errors.mean():.4f}, max {errors.max():.4f} over {errors.numel()} tokens")
    assert mode == "graph"
    assert errors.mean() < 0.03 and errors.max() < 0.3


@gpu
@needs_cuda
@STEPS
def test_gpu_graph_nf4_sampled_logprobs_match_full_forward(tmp_path, kernels: bool):
    pytest.importorskip("bitsandbytes")
    from miniverl.engine.models.loading import load_causal_lm

    qwen3_0_6b(torch.bfloat16, layers=8).save_pretrained(tmp_path)
    model = with_random_lora(load_causal_lm(tmp_path, torch.bfloat16, "cuda", nf4=True))
    mode, errors = _sampled_logprob_errors(model, load_tokenizer(), kernels)
    print(f"nf4: decoder mode {mode}; mean |dlogprob| {errors.mean():.4f}, max {errors.max():.4f} over {errors.numel()} tokens")
    assert mode == "graph", "bitsandbytes Linear4bit could not be captured in a CUDA graph"
    assert errors.mean() < 0.03 and errors.max() < 0.3
