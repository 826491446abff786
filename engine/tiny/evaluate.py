"""Judge a tiny model in the real multi-turn calculator loop (used by `tiny_train` and the tests).

`run_episodes` runs the loop, greedy or sampled, with the tool executed between
turns, and judges each trajectory with `task.judge`; `evaluate_greedy` and
`evaluate_sampled` summarise it; `first_token_tool_prob` is the probability
that a model opens its first turn with a tool call.
"""

from __future__ import annotations

from typing import Any

import torch

from miniverl.engine.tasks.calculator import (
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_TEMPLATE,
    CalcTask,
    judge,
    parse_tool_calls,
    render_prompt,
    tool_response,
)
from miniverl.engine.tiny.models import encode, masked_logits

MAX_TURNS = 3
MAX_NEW_TOKENS = 48


@torch.no_grad()
def generate_turns(
    model: Any,
    contexts: list[list[int]],
    *,
    eos_id: int,
    pad_id: int,
    max_new_tokens: int = MAX_NEW_TOKENS,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """One turn per context, batched with left padding and a KV cache.

    Greedy when temperature is 0, else plain sampling at that temperature
    (no top-k/top-p). Each turn ends with (and includes) eos, or is cut at
    `max_new_tokens`. Padded vocabulary ids are never produced.
    """
    n = len(contexts)
    width = max(len(c) for c in contexts)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    for row, ctx in enumerate(contexts):
        ids[row, width - len(ctx) :] = torch.tensor(ctx)
        attention[row, width - len(ctx) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True, logits_to_keep=1)
    generated = [[] for _ in range(n)]
    done = torch.zeros(n, dtype=torch.bool)
    next_pos = positions[:, -1:] + 1
    for _ in range(max_new_tokens):
        logits = masked_logits(out.logits[:, -1, :].float())
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        else:
            token = logits.argmax(-1)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        for row in (~done).nonzero().flatten().tolist():
            generated[row].append(int(token[row]))
        done |= token == eos_id
        if bool(done.all()):
            break
        attention = torch.cat([attention, torch.ones((n, 1), dtype=torch.long)], dim=-1)
        out = model(
            input_ids=token[:, None],
            attention_mask=attention,
            position_ids=next_pos,
            cache=out.cache,
            use_cache=True,
        )
        next_pos = next_pos + 1
    return generated


@torch.no_grad()
def run_episodes(
    model: Any,
    tokenizer: Any,
    tasks: list[CalcTask],
    *,
    temperature: float = 0.0,
    seed: int = 0,
    max_turns: int = MAX_TURNS,
    max_new_tokens: int = MAX_NEW_TOKENS,
    batch_size: int = 100,
    forced_prefix: str = "",
) -> list[dict[str, Any]]:
    """The real multi-turn loop, batched: generate a turn; if it calls the
    tool, feed back the tool response and generate the next turn.

    `forced_prefix` (a diagnostic) is written at the start of the first turn
    as if the model had produced it. When a turn holds several calls, every
    call is answered and the results are fed back on separate lines.
    Each record also holds the episode's `token_ids` and a `generated_mask`
    (1 on tokens the model sampled).
    """
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    generator = torch.Generator().manual_seed(seed)
    prefix_ids = encode(tokenizer, forced_prefix) if forced_prefix else []
    records: list[dict[str, Any]] = []
    for start in range(0, len(tasks), batch_size):
        chunk = tasks[start : start + batch_size]
        contexts = [encode(tokenizer, render_prompt(tokenizer, t)) + prefix_ids for t in chunk]
        # 1 where the model produced the token (a forced prefix counts as context).
        generated_masks = [[0] * len(c) for c in contexts]
        turns: list[list[str]] = [[] for _ in chunk]
        results: list[list[tuple[str, bool]]] = [[] for _ in chunk]
        finished = [False] * len(chunk)
        active = list(range(len(chunk)))
        for turn_index in range(max_turns):
            if not active:
                break
            outs = generate_turns(
                model,
                [contexts[i] for i in active],
                eos_id=eos_id,
                pad_id=pad_id,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                generator=generator,
            )
            still_active = []
            for i, gen in zip(active, outs):
                head = prefix_ids if turn_index == 0 else []
                text = tokenizer.decode(head + gen, skip_special_tokens=False)
                turns[i].append(text)
                contexts[i] = contexts[i] + gen
                generated_masks[i] += [1] * len(gen)
                if not gen or gen[-1] != eos_id:
                    continue  # cut at max_new_tokens: the episode is unfinished
                calls = parse_tool_calls(text)
                if not calls:
                    finished[i] = True
                    continue
                responses = [tool_response(call) for call in calls]
                results[i] += responses
                feedback = TOOL_RESPONSE_TEMPLATE.format(result="\n".join(r for r, _ in responses))
                feedback_ids = encode(tokenizer, feedback)
                contexts[i] = contexts[i] + feedback_ids
                generated_masks[i] += [0] * len(feedback_ids)
                still_active.append(i)
            active = still_active
        for task, t, r, f, ids, gmask in zip(chunk, turns, results, finished, contexts, generated_masks):
            records.append(
                {
                    "task": task,
                    "turns": t,
                    "tool_results": r,
                    "finished": f,
                    "verdict": judge(task, t, r, f),
                    "token_ids": ids,
                    "generated_mask": gmask,
                }
            )
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, float]:
    n = len(records)
    verdicts = [r["verdict"] for r in records]
    return {
        "n": n,
        "strict_success": sum(v.strict_success for v in verdicts) / n,
        "tool_call_rate": sum(v.tool_called for v in verdicts) / n,
        "correct": sum(v.correct for v in verdicts) / n,
        "finished": sum(r["finished"] for r in records) / n,
        "first_turn_opens_tool_call": sum(TOOL_CALL_OPEN in r["turns"][0] for r in records if r["turns"]) / n,
    }


def evaluate_greedy(model: Any, tokenizer: Any, tasks: list[CalcTask], **kwargs: Any) -> dict[str, float]:
    return summarize(run_episodes(model, tokenizer, tasks, temperature=0.0, **kwargs))


def evaluate_sampled(model: Any, tokenizer: Any, tasks: list[CalcTask], seed: int, temperature: float = 1.0) -> dict[str, float]:
    return summarize(run_episodes(model, tokenizer, tasks, temperature=temperature, seed=seed))


@torch.no_grad()
def first_token_tool_prob(model: Any, tokenizer: Any, tasks: list[CalcTask]) -> tuple[float, float]:
    """Mean and max probability of `<tool_call>` as the first assistant token."""
    tool_id = tokenizer.convert_tokens_to_ids(TOOL_CALL_OPEN)
    contexts = [encode(tokenizer, render_prompt(tokenizer, t)) for t in tasks]
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, ctx in enumerate(contexts):
        ids[row, width - len(ctx) :] = torch.tensor(ctx)
        attention[row, width - len(ctx) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, -1]
    probs = torch.softmax(masked_logits(logits), -1)[:, tool_id]
    return probs.mean().item(), probs.max().item()
