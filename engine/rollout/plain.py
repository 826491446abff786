"""The plain engine: batched multi-turn decoding with one shared KV cache.

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

import torch

from miniverl.engine.models.loading import cache_kwarg
from miniverl.engine.rollout.loop import Budget, Episode, SamplingPolicy, ToolLoop, select_next
from miniverl.engine.tasks.base import Task, TaskItem


@torch.no_grad()
def run_batch(model, tool_loop: ToolLoop, tasks: list[TaskItem], policy: SamplingPolicy,
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


def run_episodes_plain(model, tokenizer, task: Task, tasks: list[TaskItem], policy: SamplingPolicy, budget: Budget,
                       generator: torch.Generator | None, vocab_limit: int, device: str, batch_size: int,
                       on_batch=None, first_turn_prefix: str = "") -> list[Episode]:
    """`first_turn_prefix`: forced context that opens every first turn (see `ToolLoop`); empty for rollout and verify."""
    tool_loop = ToolLoop(tokenizer, task, budget, first_turn_prefix)
    episodes: list[Episode] = []
    for start in range(0, len(tasks), batch_size):
        episodes.extend(run_batch(model, tool_loop, tasks[start:start + batch_size], policy, generator, vocab_limit, device))
        if on_batch is not None:
            on_batch(len(episodes))
    return episodes
