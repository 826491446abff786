"""Rollout: the student samples this cycle's trajectories in the tool loop.

reads policy checkpoint k; writes cycles/k/rollout.msgpack (token ids, span
provenance, sampling log-probs, tool calls and results, verdicts).
"""

from __future__ import annotations

import torch

from miniverl.engine.core import layout
from miniverl.engine.core.artifacts import Rollout, RolloutSummary, Trajectory
from miniverl.engine.core.layout import Ref, StageKey
from miniverl.engine.models.host import ModelHost
from miniverl.engine.core.progress import Reporter
from miniverl.engine.core.recipe import Recipe
from miniverl.engine.rollout.engines import run_episodes
from miniverl.engine.rollout.loop import Budget, SamplingPolicy
from miniverl.engine.core.seeding import derive_seed, generator
from miniverl.engine.tasks.base import Task
from miniverl.stages.contract import Output, StageContext, artifact_output, checkpoint_inputs

NAME = layout.ROLLOUT


def cycle_tasks(recipe: Recipe, task: Task, cycle: int):
    """Training prompts of one cycle: a fresh draw from the train split."""
    seed = derive_seed(recipe.task.train_seed, cycle, "prompts")
    return task.items("train", recipe.train.rollouts_per_cycle, seed)


def sample(recipe: Recipe, host: ModelHost, task: Task, adapter: dict[str, torch.Tensor], adapter_sha256: str,
           cycle: int, reporter: Reporter) -> Rollout:
    model = host.student(adapter)
    tasks = cycle_tasks(recipe, task, cycle)
    r = recipe.rollout
    policy = SamplingPolicy(greedy=False, temperature=r.temperature, top_p=r.top_p)
    budget = Budget(r.max_turns, r.max_new_tokens_per_turn, r.max_total_tokens)
    gen = generator(recipe.seed, cycle, "rollout", device=host.device)
    with reporter.bar(f"cycle {cycle} rollout", len(tasks), "trajectories") as advance:
        done = [0]

        def on_batch(n: int) -> None:
            advance(n - done[0])
            done[0] = n

        episodes = run_episodes(model, host.tokenizer, task, tasks, policy, budget, gen, host.vocab_limit,
                                host.device, r.generation_batch_size, on_batch, engine=r.engine,
                                dense_copy=r.dense_copy is True)
    trajectories = []
    for ep in episodes:
        verdict = ep.verdict()
        trajectories.append(Trajectory(
            task_id=ep.task.task_id, question=ep.task.question,
            answer=ep.task.answer, token_ids=ep.token_ids, provenance=ep.provenance,
            sampling_logprobs=ep.sampling_logprobs, turns=ep.turns,
            tool_results=[text for text, _ in ep.tool_results], tool_ok=[ok for _, ok in ep.tool_results],
            finish_reason=ep.finish_reason, tool_called=verdict.tool_called,
            format_valid=verdict.format_valid, strict_success=verdict.strict_success,
        ))
    return Rollout(
        cycle=cycle, policy_adapter_sha256=adapter_sha256, temperature=r.temperature, top_p=r.top_p,
        trajectories=trajectories, generated_tokens=sum(len(t.sampling_logprobs) for t in trajectories),
    )


def inputs(key: StageKey, recipe: Recipe) -> dict[str, Ref]:
    return checkpoint_inputs(key.cycle)


def outputs(key: StageKey, recipe: Recipe) -> list[Ref]:
    return [layout.rollout_ref(key.cycle)]


def run(ctx: StageContext, got: dict) -> list[Output]:
    rollout = sample(ctx.recipe, ctx.host, ctx.task, got["adapter"], got["checkpoint"].adapter_sha256, ctx.key.cycle, ctx.reporter)
    return [artifact_output(layout.rollout_ref(ctx.key.cycle), rollout, RolloutSummary.of(rollout))]
