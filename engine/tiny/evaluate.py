"""Judge a tiny model in the episode loop that rollout and verify run (used by `tiny.train` and the tests).

`run_tiny_episodes` decodes with the plain engine (`rollout.plain`) and the
shared `ToolLoop`, under the tiny budget: at most three turns of 48 sampled
tokens, a token total that never binds before the models' 512 positions, and
logits cut to the tokenizer's 397 rows so a padded row is never sampled. Each
trajectory is judged by `Episode.verdict()`, as verify judges it.
`evaluate_greedy` and `evaluate_sampled` summarise the episodes;
`first_token_tool_prob` is the probability that a model opens its first turn
with a tool call (one forward pass, no episode).
"""

from __future__ import annotations

from typing import Any

import torch

from miniverl.engine.rollout.loop import Budget, Episode, SamplingPolicy
from miniverl.engine.rollout.plain import run_episodes_plain
from miniverl.engine.tasks.base import Task, TaskItem
from miniverl.engine.tasks.protocol import TOOL_CALL_OPEN, render_prompt
from miniverl.engine.tiny.models import MAX_POSITION_EMBEDDINGS, encode, masked_logits

MAX_TURNS = 3
MAX_NEW_TOKENS = 48
BUDGET = Budget(max_turns=MAX_TURNS, max_new_tokens_per_turn=MAX_NEW_TOKENS, max_total_tokens=MAX_POSITION_EMBEDDINGS)
BATCH_SIZE = 100
# A SQL call is up to ~56 tiny-tokenizer tokens; every other bound is the calculator's.
BUDGETS = {"calculator": BUDGET, "sql": Budget(max_turns=MAX_TURNS, max_new_tokens_per_turn=72,
                                             max_total_tokens=MAX_POSITION_EMBEDDINGS)}


def run_tiny_episodes(model: Any, tokenizer: Any, task: Task, items: list[TaskItem], policy: SamplingPolicy,
                      generator: torch.Generator | None = None, first_turn_prefix: str = "") -> list[Episode]:
    """The rollout/verify episode loop under the tiny budget; `first_turn_prefix` is forced context (see `ToolLoop`)."""
    budget = BUDGETS.get(task.name, BUDGET)
    return run_episodes_plain(model, tokenizer, task, items, policy, budget, generator, len(tokenizer),
                              model.device.type, BATCH_SIZE, first_turn_prefix=first_turn_prefix)


def summarize(episodes: list[Episode]) -> dict[str, float]:
    n = len(episodes)
    verdicts = [e.verdict() for e in episodes]
    return {
        "n": n,
        "strict_success": sum(v.strict_success for v in verdicts) / n,
        "tool_call_rate": sum(v.tool_called for v in verdicts) / n,
        "correct": sum(v["correct"] for v in verdicts) / n,
        # A final answer ended the episode: not cut by a token or turn budget.
        "finished": sum(e.finish_reason == "stop" for e in episodes) / n,
        "first_turn_opens_tool_call": sum(TOOL_CALL_OPEN in e.turns[0] for e in episodes if e.turns) / n,
    }


def evaluate_greedy(model: Any, tokenizer: Any, task: Task, items: list[TaskItem],
                    first_turn_prefix: str = "") -> dict[str, float]:
    episodes = run_tiny_episodes(model, tokenizer, task, items, SamplingPolicy(greedy=True),
                                 first_turn_prefix=first_turn_prefix)
    return summarize(episodes)


def evaluate_sampled(model: Any, tokenizer: Any, task: Task, items: list[TaskItem], seed: int,
                     temperature: float = 1.0) -> dict[str, float]:
    """Plain sampling at `temperature` (no top-p) from a generator seeded with `seed`."""
    generator = torch.Generator(device=model.device).manual_seed(seed)
    policy = SamplingPolicy(greedy=False, temperature=temperature, top_p=1.0)
    return summarize(run_tiny_episodes(model, tokenizer, task, items, policy, generator))


@torch.no_grad()
def first_token_tool_prob(model: Any, tokenizer: Any, task: Task, items: list[TaskItem]) -> tuple[float, float]:
    """Mean and max probability of `<tool_call>` as the first assistant token."""
    tool_id = tokenizer.convert_tokens_to_ids(TOOL_CALL_OPEN)
    contexts = [encode(tokenizer, render_prompt(tokenizer, task, t)) for t in items]
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, ctx in enumerate(contexts):
        ids[row, width - len(ctx) :] = torch.tensor(ctx)
        attention[row, width - len(ctx) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, -1]
    probs = torch.softmax(masked_logits(logits, len(tokenizer)), -1)[:, tool_id]
    return probs.mean().item(), probs.max().item()
