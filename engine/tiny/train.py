"""Train the three embedded tiny models of a task family, deterministically, on a CPU.

    python -m miniverl.engine.tiny.train            # the calculator's three, into engine/assets/tiny/
    python -m miniverl.engine.tiny.train --only student_base --out-root /tmp/tiny
    python -m miniverl.engine.tiny.train --family sql --build-tokenizer   # the sql family, tokenizer first

The traces come from the task itself (`Task.items`, the oracle's
`reference_calls`, what the task's tools return for them, `final_answer_text`),
rendered by the same protocol code the tool loop uses, so one script serves
every family. Below, the calculator's words; for `sql` read "query" for
"expression".

What is trained (see `tiny.models` for the configs):

- ``protocol_teacher`` learns the full protocol trace: call the calculator
  with the question's exact expression, read the tool response, answer
  "The answer is N." by copying the tool result.
- ``raw_teacher`` (same config) learns to answer directly, no tool: the
  negative control. It cannot multiply three-digit numbers, so its answers are
  mostly wrong, and it never calls the tool.
- ``student_base`` is built in two phases, like an instruct model that learned
  to ignore its tools. Phase 1 pretrains it on protocol traces, so it holds
  the copying circuits (expression -> tool call, tool result -> answer) and
  knows the tool-call format. Phase 2 (``ignore_tools``) fine-tunes it,
  briefly, on direct-answer traces, interleaved with protocol traces whose
  first assistant token (the ``<tool_call>`` decision) is left out of the
  loss, until it never opens a tool call (0% greedy, 0/200 sampled at
  temperature 1; P(<tool_call> first) ~2e-4). So the decision to call the
  tool is suppressed at the first assistant token while the rest of the
  protocol stays trained: forced to start its first turn with
  ``<tool_call>``, the base student still completes the call and copies the
  result. (Direct-answer traces alone also reach 0% tool calls, but even at a
  low learning rate they wreck the forced continuation, which then turns into
  "The answer is ..." after ``<tool_call>``.) That is what makes on-policy
  distillation from the protocol teacher work with a rank-8 LoRA adapter in a
  few dozen steps: the teacher's per-token KL only has to move the decision,
  not teach a skill from nothing; a student that already called the tool
  would make the distillation trivial.

Training is plain torch: AdamW, float32, masked next-token cross-entropy on
the model-generated tokens only (assistant turns, each with its closing
``<|im_end|>``; prompts and tool responses are context), right-padded batches
with ``<|endoftext|>``, logits of the padded vocabulary rows (ids >= 397)
masked to -inf so they get no probability and no gradient. Seeds are fixed
everywhere (model init, batch order, task lists) and deterministic algorithms
are on; results are reproducible on the same machine and thread count.
Training tasks come from ``Task.items("train", ...)`` only; evaluation uses
``Task.items("heldout", ...)``, which no training item can be in.

Each model is judged after training by `tiny.evaluate`, in the episode loop and
`ToolLoop` that rollout and verify run.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from miniverl.engine.models import loading
from miniverl.engine.tasks.base import Task, TaskItem
from miniverl.engine.tasks.protocol import END_OF_TURN, TOOL_CALL_OPEN, assistant_turn_text, render_prompt, tool_responses_text
from miniverl.engine.tiny.evaluate import evaluate_greedy, evaluate_sampled, first_token_tool_prob
from miniverl.engine.tiny.models import (
    FAMILIES,
    MODEL_NAMES,
    SPECS,
    TOKENIZER_NAME,
    TinyFamily,
    build_model,
    encode,
    load_tokenizer,
    masked_logits,
    parameter_count,
)
from miniverl.engine.tiny.tokenizer import build_tokenizer, training_items

NUM_THREADS = 2
TRAIN_TASK_SEED = 1234
EVAL_TASK_SEED = 2024
EVAL_TASKS = 200


@dataclass(frozen=True)
class Phase:
    trace: str  # "protocol" or "direct"
    steps: int
    lr: float
    batch_size: int = 64
    warmup: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    task_seed: int = TRAIN_TASK_SEED


# One recipe per shipped model; every family trains the same way, from its own seeds.
# Phase task seeds differ so the student's phases see different training items.
def family_recipes(first_seed: int) -> dict[str, dict[str, Any]]:
    return {
        "protocol_teacher": {"seed": first_seed, "phases": [Phase("protocol", steps=500, lr=2e-3)]},
        "raw_teacher": {"seed": first_seed + 1, "phases": [Phase("direct", steps=300, lr=2e-3)]},
        "student_base": {
            "seed": first_seed + 2,
            "phases": [
                Phase("protocol", steps=600, lr=2e-3, task_seed=TRAIN_TASK_SEED + 1),
                Phase("ignore_tools", steps=150, lr=5e-4, warmup=10, task_seed=TRAIN_TASK_SEED + 2),
            ],
        },
    }


RECIPES: dict[str, dict[str, dict[str, Any]]] = {"calculator": family_recipes(11), "sql": family_recipes(21)}
# A tool error the tokenizer's corpus shows once per trace, so error texts stay short.
ERROR_EXAMPLES = {"calculator": "error: invalid expression", "sql": "error: no such column"}


def build_family_task(family: TinyFamily) -> Task:
    from miniverl.engine.tasks.registry import BUILTINS, build_task
    from miniverl.engine.core.recipe import TaskSpec

    assert family.task in BUILTINS
    return build_task(TaskSpec(name=family.task), {})



# ---------------------------------------------------------------- encoding


def encode_trace(tokenizer: Any, task: Task, item: TaskItem, trace: str) -> tuple[list[int], list[int]]:
    """Token ids of one trace and a 0/1 mask of the model-generated tokens.

    Segments are tokenized one by one and concatenated, exactly as the
    multi-turn loop builds its context; the tool responses are what the
    task's tools return for the oracle's calls.
    """
    answer = task.final_answer_text(item.answer) + END_OF_TURN
    prompt = render_prompt(tokenizer, task, item)
    if trace == "protocol":
        results = [task.run_call(task.check_call(call)).text for call in item.reference_calls]
        segments = [
            (prompt, 0),
            (assistant_turn_text("", item.reference_calls) + END_OF_TURN, 1),
            (tool_responses_text(results), 0),
            (answer, 1),
        ]
    elif trace == "direct":
        segments = [(prompt, 0), (answer, 1)]
    elif trace == "protocol_continuation":
        # The protocol after its first token: the decision to call the tool is
        # not trained, everything that follows it is.
        ids, mask = encode_trace(tokenizer, task, item, "protocol")
        first = mask.index(1)
        return ids, mask[:first] + [0] + mask[first + 1 :]
    else:
        raise ValueError(f"unknown trace kind {trace!r}")
    ids: list[int] = []
    mask: list[int] = []
    for text, generated in segments:
        part = encode(tokenizer, text)
        ids += part
        mask += [generated] * len(part)
    return ids, mask


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded inputs, next-token targets and the loss mask on targets."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.bool)
    for row, (seq, m) in enumerate(examples):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(m)] = torch.tensor(m, dtype=torch.bool)
    return ids[:, :-1], ids[:, 1:], mask[:, 1:]


def lm_loss(model: Any, inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, tokenizer_size: int) -> torch.Tensor:
    # Right padding under a causal mask never affects real tokens: no attention mask needed.
    logits = masked_logits(model(input_ids=inputs).logits, tokenizer_size)
    return F.cross_entropy(logits[mask], targets[mask])


# ---------------------------------------------------------------- training


def lr_at(step: int, phase: Phase) -> float:
    if step < phase.warmup:
        return phase.lr * (step + 1) / phase.warmup
    progress = (step - phase.warmup) / max(1, phase.steps - phase.warmup)
    return phase.lr * (phase.min_lr_ratio + (1 - phase.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def trace_kind(phase_trace: str, index: int) -> str:
    """`ignore_tools` alternates direct answers with protocol continuations.

    The model learns to answer without opening a tool call, while what follows
    an opened call stays trained: an instruct model that ignores its tools but
    still knows how to use them.
    """
    if phase_trace != "ignore_tools":
        return phase_trace
    return "direct" if index % 2 == 0 else "protocol_continuation"


def train_phase(model: Any, tokenizer: Any, task: Task, phase: Phase, seed: int, log_every: int = 50) -> list[float]:
    items = training_items(task, phase.steps * phase.batch_size, seed=phase.task_seed)
    examples = [encode_trace(tokenizer, task, item, trace_kind(phase.trace, i)) for i, item in enumerate(items)]
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": phase.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=phase.lr,
        betas=(0.9, 0.98),
        eps=1e-8,
    )
    model.train()
    losses: list[float] = []
    started = time.time()
    for step in range(phase.steps):
        batch = [examples[i] for i in order[step * phase.batch_size : (step + 1) * phase.batch_size].tolist()]
        inputs, targets, mask = collate(batch, tokenizer.pad_token_id)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, phase)
        loss = lm_loss(model, inputs, targets, mask, len(tokenizer))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if log_every and ((step + 1) % log_every == 0 or step == 0):
            recent = losses[-log_every:]
            print(
                f"  [{phase.trace}] step {step + 1}/{phase.steps} loss {sum(recent) / len(recent):.4f} "
                f"lr {lr_at(step, phase):.2e} {time.time() - started:.0f}s",
                flush=True,
            )
    model.eval()
    return losses


# ---------------------------------------------------------------- building


def train_model(name: str, tokenizer: Any, task: Task, family: TinyFamily) -> Any:
    recipe = RECIPES[family.task][name]
    model = build_model(SPECS[name], tokenizer, seed=recipe["seed"])
    print(f"{name}: {parameter_count(model):,} parameters", flush=True)
    for index, phase in enumerate(recipe["phases"]):
        torch.manual_seed(recipe["seed"] * 100 + index)
        train_phase(model, tokenizer, task, phase, seed=recipe["seed"] * 100 + index)
    return model


def save_model(model: Any, tokenizer_dir: Path, out_dir: Path) -> None:
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    model.float().save_pretrained(str(out_dir), safe_serialization=True)
    for path in sorted(tokenizer_dir.iterdir()):
        if path.is_file():
            shutil.copyfile(path, out_dir / path.name)


def report(name: str, model: Any, tokenizer: Any, task: Task) -> dict[str, Any]:
    heldout = task.items("heldout", min(EVAL_TASKS, task.capacity("heldout")), seed=EVAL_TASK_SEED)
    metrics: dict[str, Any] = {"parameters": parameter_count(model),
                               "greedy": evaluate_greedy(model, tokenizer, task, heldout)}
    if name == "student_base":
        metrics["sampled_t1"] = evaluate_sampled(model, tokenizer, task, heldout, seed=EVAL_TASK_SEED)
        metrics["forced_tool_call_greedy"] = evaluate_greedy(model, tokenizer, task, heldout, first_turn_prefix=TOOL_CALL_OPEN)
        metrics["first_token_tool_prob_mean_max"] = first_token_tool_prob(model, tokenizer, task, heldout)
    return metrics


# The held-out success each family's protocol teacher and forced student must reach. The sql
# teacher writes a 40-token query from a question it has not seen (new entity combinations):
# 0.95, where the calculator's copies a 7-character expression.
SKILL_BARS = {"calculator": 0.97, "sql": 0.95}


def check(name: str, metrics: dict[str, Any], bar: float = 0.97) -> list[str]:
    greedy = metrics["greedy"]
    problems = []
    if name == "protocol_teacher" and greedy["strict_success"] < bar:
        problems.append(f"protocol_teacher strict success {greedy['strict_success']:.3f} < {bar}")
    if name in ("raw_teacher", "student_base") and greedy["tool_call_rate"] > 0:
        problems.append(f"{name} greedy tool-call rate {greedy['tool_call_rate']:.3f} > 0")
    if name == "student_base" and metrics["sampled_t1"]["tool_call_rate"] > 0.01:
        problems.append(f"student_base sampled tool-call rate {metrics['sampled_t1']['tool_call_rate']:.3f} > 0.01")
    if name == "student_base" and metrics["forced_tool_call_greedy"]["strict_success"] < bar:
        forced = metrics["forced_tool_call_greedy"]["strict_success"]
        problems.append(f"student_base forced to open a tool call succeeds {forced:.3f} < {bar}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="calculator", help="which task's models")
    parser.add_argument("--only", choices=MODEL_NAMES, action="append", help="train only these models")
    parser.add_argument("--out-root", type=Path, default=None, help="default: the family's assets directory")
    parser.add_argument("--build-tokenizer", action="store_true", help="train the family's BPE tokenizer first")
    args = parser.parse_args(argv)

    torch.set_num_threads(NUM_THREADS)
    torch.use_deterministic_algorithms(True)
    family = FAMILIES[args.family]
    task = build_family_task(family)
    out_root = args.out_root or family.root
    tokenizer_dir = (out_root if args.build_tokenizer else family.root) / TOKENIZER_NAME
    if args.build_tokenizer:
        build_tokenizer(tokenizer_dir, task, ERROR_EXAMPLES[family.task], family.bpe_vocab_size)
        tokenizer = loading.load_tokenizer(tokenizer_dir)  # its size is what the new family's constant records
        print(f"tokenizer: {len(tokenizer)} tokens in {tokenizer_dir}", flush=True)
    else:
        tokenizer = load_tokenizer(tokenizer_dir, family)
    problems: list[str] = []
    all_metrics: dict[str, Any] = {}
    total_start = time.time()
    for name in args.only or MODEL_NAMES:
        started = time.time()
        model = train_model(name, tokenizer, task, family)
        train_seconds = time.time() - started
        metrics = report(name, model, tokenizer, task)
        metrics["train_seconds"] = round(train_seconds, 1)
        save_model(model, tokenizer_dir, out_root / name)
        all_metrics[name] = metrics
        problems += check(name, metrics, SKILL_BARS[family.task])
        print(f"{name}: {json.dumps(metrics, default=str)}", flush=True)
    print(f"total {time.time() - total_start:.0f}s", flush=True)
    for problem in problems:
        print(f"FAILED: {problem}", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
