"""Batched multi-turn decoding with the calculator tool in the loop.

All sequences of a batch advance in lockstep, one token per step, through one
KV cache. A row's next token is either *forced* (the rest of its prompt, or a
tool response it is being fed) or *sampled* from the policy. So a sequence that
calls the tool keeps its place in the batch: its tool response is prefilled
token by token while the other rows keep generating, and no padding or
per-row position bookkeeping is ever needed. Finished rows are dropped from
the cache. This plain loop is the CPU path and the reference for faster
engines: greedy decoding here is token-for-token what a full forward pass
per token gives.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from .artifacts import PROVENANCE_MODEL, PROVENANCE_PROMPT, PROVENANCE_TOOL
from .models import cache_kwarg
from .task import TOOL_RESPONSE_TEMPLATE, CalcTask, judge, parse_tool_calls, render_prompt, tool_response


@dataclass(frozen=True)
class SamplingPolicy:
    greedy: bool
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass(frozen=True)
class Budget:
    max_turns: int
    max_new_tokens_per_turn: int
    max_total_tokens: int


@dataclass
class Episode:
    task: CalcTask
    token_ids: list[int]
    provenance: list[int]
    pending: deque[tuple[int, int]]  # forced (token, provenance) still to feed
    sampling_logprobs: list[float] = field(default_factory=list)
    turn_tokens: list[int] = field(default_factory=list)
    turns: list[str] = field(default_factory=list)
    tool_results: list[tuple[str, bool]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str = ""

    def verdict(self):
        return judge(self.task, self.turns, self.tool_results, self.finish_reason == "stop")


def select_next(logits_RV: torch.Tensor, policy: SamplingPolicy, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens and their log-probs under the distribution actually sampled from."""
    logits_RV = logits_RV.float()
    if policy.greedy:
        logprobs_RV = torch.log_softmax(logits_RV, dim=-1)
        tokens_R = logits_RV.argmax(dim=-1)
        return tokens_R, logprobs_RV.gather(1, tokens_R[:, None])[:, 0]
    logits_RV = logits_RV / policy.temperature
    if policy.top_p < 1.0:
        # Keep the smallest set of tokens whose probability reaches top_p.
        sorted_logits, order = logits_RV.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= policy.top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits_RV = logits_RV.masked_fill(drop, float("-inf"))
    logprobs_RV = torch.log_softmax(logits_RV, dim=-1)
    tokens_R = torch.multinomial(logprobs_RV.exp(), 1, generator=generator)[:, 0]
    return tokens_R, logprobs_RV.gather(1, tokens_R[:, None])[:, 0]


class ToolLoop:
    """Turn bookkeeping shared by every engine: what happens after a model token."""

    def __init__(self, tokenizer, budget: Budget):
        self.tokenizer = tokenizer
        self.budget = budget
        self.end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def start(self, task: CalcTask) -> Episode:
        ids = self.tokenizer(render_prompt(self.tokenizer, task), add_special_tokens=False).input_ids
        return Episode(task, [], [], deque((t, PROVENANCE_PROMPT) for t in ids))

    def feed_forced(self, episode: Episode) -> int:
        token, provenance = episode.pending.popleft()
        episode.token_ids.append(token)
        episode.provenance.append(provenance)
        return token

    def feed_sampled(self, episode: Episode, token: int, logprob: float) -> None:
        episode.token_ids.append(token)
        episode.provenance.append(PROVENANCE_MODEL)
        episode.sampling_logprobs.append(logprob)
        episode.turn_tokens.append(token)
        if token == self.end_of_turn:
            self._end_turn(episode)
        elif len(episode.turn_tokens) >= self.budget.max_new_tokens_per_turn or len(episode.token_ids) >= self.budget.max_total_tokens:
            self._close_turn(episode)
            self._finish(episode, "length")

    def _close_turn(self, episode: Episode) -> str:
        text = self.tokenizer.decode(episode.turn_tokens, skip_special_tokens=False)
        episode.turns.append(text)
        episode.turn_tokens = []
        return text

    def _end_turn(self, episode: Episode) -> None:
        calls = parse_tool_calls(self._close_turn(episode))
        if not calls:
            self._finish(episode, "stop")
            return
        result = tool_response(calls[0])
        episode.tool_results.append(result)
        if len(episode.turns) >= self.budget.max_turns:
            self._finish(episode, "max_turns")
            return
        response = self.tokenizer(TOOL_RESPONSE_TEMPLATE.format(result=result[0]), add_special_tokens=False).input_ids
        if len(episode.token_ids) + len(response) >= self.budget.max_total_tokens:
            self._finish(episode, "length")
            return
        episode.pending.extend((t, PROVENANCE_TOOL) for t in response)

    @staticmethod
    def _finish(episode: Episode, reason: str) -> None:
        episode.finished = True
        episode.finish_reason = reason


@torch.no_grad()
def run_batch(model, tool_loop: ToolLoop, tasks: list[CalcTask], policy: SamplingPolicy,
              generator: torch.Generator | None, vocab_limit: int, device: str) -> list[Episode]:
    """Decode one batch of episodes to completion with a shared KV cache."""
    from transformers import DynamicCache

    episodes = [tool_loop.start(task) for task in tasks]
    common = min(len(e.pending) for e in episodes)
    prefill = [[tool_loop.feed_forced(e) for _ in range(common)] for e in episodes]
    cache = DynamicCache()
    kw = cache_kwarg(model)
    active = list(range(len(episodes)))  # row i of the cache is episodes[active[i]]
    out = model(input_ids=torch.tensor(prefill, device=device), use_cache=True, logits_to_keep=1, **{kw: cache})
    while True:
        logits_RV = out.logits[:, -1, :vocab_limit]
        sample_rows = [r for r, e in enumerate(active) if not episodes[e].pending]
        forced_rows = [r for r, e in enumerate(active) if episodes[e].pending]
        next_tokens = [0] * len(active)
        if sample_rows:
            tokens, logprobs = select_next(logits_RV[sample_rows], policy, generator)
            for r, token, logprob in zip(sample_rows, tokens.tolist(), logprobs.tolist()):
                next_tokens[r] = token
                tool_loop.feed_sampled(episodes[active[r]], token, logprob)
        for r in forced_rows:
            next_tokens[r] = tool_loop.feed_forced(episodes[active[r]])
        keep = [r for r, e in enumerate(active) if not episodes[e].finished]
        if not keep:
            return episodes
        if len(keep) < len(active):
            cache.batch_select_indices(torch.tensor(keep, device=device))
            active = [active[r] for r in keep]
            next_tokens = [next_tokens[r] for r in keep]
        step = torch.tensor(next_tokens, device=device)[:, None]
        out = model(input_ids=step, use_cache=True, logits_to_keep=1, **{kw: cache})


def run_episodes(model, tokenizer, tasks: list[CalcTask], policy: SamplingPolicy, budget: Budget,
                 generator: torch.Generator | None, vocab_limit: int, device: str, batch_size: int,
                 on_batch=None, engine: str = "auto") -> list[Episode]:
    """`engine`: `auto` decodes with the CUDA-graph engine on CUDA; `plain` always runs the forward-pass loop."""
    if device == "cuda" and engine == "auto":  # the engine runs the plain loop for models it does not cover
        from .cuda_graph_engine import run_episodes_fast

        return run_episodes_fast(model, tokenizer, tasks, policy, budget, generator, vocab_limit, device,
                                 batch_size, on_batch)
    return run_episodes_plain(model, tokenizer, tasks, policy, budget, generator, vocab_limit, device,
                              batch_size, on_batch)


def run_episodes_plain(model, tokenizer, tasks: list[CalcTask], policy: SamplingPolicy, budget: Budget,
                       generator: torch.Generator | None, vocab_limit: int, device: str, batch_size: int,
                       on_batch=None) -> list[Episode]:
    tool_loop = ToolLoop(tokenizer, budget)
    episodes: list[Episode] = []
    for start in range(0, len(tasks), batch_size):
        episodes.extend(run_batch(model, tool_loop, tasks[start:start + batch_size], policy, generator, vocab_limit, device))
        if on_batch is not None:
            on_batch(len(episodes))
    return episodes
