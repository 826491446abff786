"""One place that picks the decoding engine for a rollout or a verify.

`auto` takes the CUDA-graph slot engine on CUDA for the models it covers
(its decode step through the Triton kernels where those are faster:
fused_step.AUTO_MAX_SLOTS) and the plain loop everywhere else; `graph` the
same engine with the module-by-module step only; `plain` always the plain loop. Both
return the same `Episode` objects through the same `ToolLoop`.
"""

from __future__ import annotations

import torch

from miniverl.engine.rollout.cuda_graph import run_episodes_fast
from miniverl.engine.rollout.loop import Budget, Episode, SamplingPolicy
from miniverl.engine.rollout.plain import run_episodes_plain
from miniverl.engine.tasks.base import Task, TaskItem


def run_episodes(model, tokenizer, task: Task, tasks: list[TaskItem], policy: SamplingPolicy, budget: Budget,
                 generator: torch.Generator | None, vocab_limit: int, device: str, batch_size: int,
                 on_batch=None, engine: str = "auto", dense_copy: bool = False) -> list[Episode]:
    """`engine`: `auto` decodes with the CUDA-graph engine on CUDA (the Triton decode step where faster),
    `graph` with that engine's module step, `plain` always with the forward-pass loop. `dense_copy`
    (rollout.dense_copy as planned): that engine's module step on a dequantized copy of NF4 weights."""
    if device == "cuda" and engine in ("auto", "graph"):  # the engine runs the plain loop for models it does not cover
        return run_episodes_fast(model, tokenizer, task, tasks, policy, budget, generator, vocab_limit, device,
                                 batch_size, on_batch, kernels=None if engine == "auto" else False,
                                 dense_copy=dense_copy)
    return run_episodes_plain(model, tokenizer, task, tasks, policy, budget, generator, vocab_limit, device,
                              batch_size, on_batch)


