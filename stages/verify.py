"""Verify: the strict held-out verifier, greedy decoding on the held-out split.

reads the initial (baseline) or final policy checkpoint; writes the verifier
report: tool-call rate, format validity and strict success, item by item.
"""

from __future__ import annotations

import torch

from miniverl.engine.core import layout
from miniverl.engine.core.artifacts import VerifyItem, VerifyReport
from miniverl.engine.core.layout import Ref, StageKey
from miniverl.engine.models.host import ModelHost
from miniverl.engine.core.progress import Reporter
from miniverl.engine.core.recipe import Recipe
from miniverl.engine.rollout.engines import run_episodes
from miniverl.engine.rollout.loop import Budget, SamplingPolicy
from miniverl.engine.tasks.base import Task
from miniverl.stages.contract import Output, StageContext, artifact_output, checkpoint_inputs

NAME = layout.VERIFY


def heldout_items(recipe: Recipe, task: Task):
    return task.items("heldout", recipe.task.heldout_size, recipe.task.heldout_seed)


def evaluate(recipe: Recipe, host: ModelHost, task: Task, adapter: dict[str, torch.Tensor], adapter_sha256: str,
             label: str, reporter: Reporter) -> VerifyReport:
    model = host.student(adapter)
    tasks = heldout_items(recipe, task)
    budget = Budget(recipe.rollout.max_turns, recipe.verify.max_new_tokens_per_turn, recipe.rollout.max_total_tokens)
    with reporter.bar(f"verify ({label})", len(tasks), "tasks") as advance:
        done = [0]

        def on_batch(n: int) -> None:
            advance(n - done[0])
            done[0] = n

        episodes = run_episodes(model, host.tokenizer, task, tasks, SamplingPolicy(greedy=True), budget, None,
                                host.vocab_limit, host.device, recipe.verify.batch_size, on_batch,
                                engine=recipe.rollout.engine)
    items = []
    for ep in episodes:
        v = ep.verdict()
        items.append(VerifyItem(
            task_id=ep.task.task_id, question=ep.task.question, turns=ep.turns, tool_called=v.tool_called,
            format_valid=v.format_valid, strict_success=v.strict_success, checks=dict(v.checks),
        ))
    n = len(items)
    return VerifyReport(
        label=label, policy_adapter_sha256=adapter_sha256, tasks=n,
        tool_call_rate=sum(i.tool_called for i in items) / n,
        format_validity=sum(i.format_valid for i in items) / n,
        strict_success=sum(i.strict_success for i in items) / n,
        items=items,
    )


def inputs(key: StageKey, recipe: Recipe) -> dict[str, Ref]:
    return checkpoint_inputs(layout.verified_step(key.label, recipe.train.cycles))


def outputs(key: StageKey, recipe: Recipe) -> list[Ref]:
    return [layout.verify_ref(key.label)]


def run(ctx: StageContext, got: dict) -> list[Output]:
    label = ctx.key.label
    report = evaluate(ctx.recipe, ctx.host, ctx.task, got["adapter"], got["checkpoint"].adapter_sha256, label, ctx.reporter)
    return [artifact_output(layout.verify_ref(label), report)]
