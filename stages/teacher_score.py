"""Teacher-score: the teacher's targets at the model-generated positions only.

What is stored depends on the loss mode: `sampled_kl` keeps the teacher's
log-prob of each sampled token, `topk_tail` its top-k ids and log-probs, and
`exact` its final hidden states (the gradient stage applies the teacher's LM
head chunk by chunk, so the [T, V] teacher logits never exist at once).

reads cycles/k/rollout.msgpack; writes cycles/k/teacher_score.safetensors and
the TeacherScore record that names it and the rollout it scored.
"""

from __future__ import annotations

import torch

from miniverl.engine.core import layout
from miniverl.engine.core.artifacts import Rollout, TeacherScore
from miniverl.engine.core.layout import Ref, StageKey
from miniverl.engine.distill.losses import teacher_topk, token_logprobs
from miniverl.engine.models.host import ModelHost
from miniverl.engine.models.loading import decoder_and_head
from miniverl.engine.core.progress import Reporter
from miniverl.engine.core.recipe import Recipe
from miniverl.engine.models.sequences import micro_batches, predicting_hidden
from miniverl.stages.contract import Output, StageContext, artifact_output, tensor_output

NAME = layout.TEACHER_SCORE


@torch.no_grad()
def score(recipe: Recipe, host: ModelHost, rollout: Rollout, reporter: Reporter) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Per-trajectory position counts and the target tensors, rows in trajectory order."""
    body, head_VH = decoder_and_head(host.teacher())
    mode, chunk = recipe.loss.mode, recipe.loss.chunk_size
    pad_id = host.tokenizer.pad_token_id
    outputs: dict[str, list[torch.Tensor]] = {}
    batches = micro_batches(rollout.trajectories, recipe.train.score_batch)
    with reporter.bar(f"cycle {rollout.cycle} teacher-score", len(rollout.trajectories), "trajectories") as advance:
        for batch in batches:
            hidden_NH, tokens_N = predicting_hidden(body, batch, pad_id, host.device)
            if mode == "exact":
                outputs.setdefault("teacher_hidden", []).append(hidden_NH.cpu())
            for start in range(0, hidden_NH.shape[0] if mode != "exact" else 0, chunk):
                # Upcast the chunk's logits, not the head (a float32 copy of a bf16 head is ~1 GiB).
                logits_CV = (hidden_NH[start : start + chunk].to(head_VH.dtype) @ head_VH.T).float()
                if mode == "sampled_kl":
                    lp = token_logprobs(logits_CV, tokens_N[start : start + chunk], host.vocab_limit)
                    outputs.setdefault("teacher_logprobs", []).append(lp.cpu())
                elif mode == "topk_tail":
                    ids, lps = teacher_topk(logits_CV, recipe.loss.topk, host.vocab_limit)
                    outputs.setdefault("topk_ids", []).append(ids.cpu())
                    outputs.setdefault("topk_logprobs", []).append(lps.cpu())
            advance(len(batch))
    positions = [len(t.sampling_logprobs) for t in rollout.trajectories]
    return positions, {name: torch.cat(parts) for name, parts in outputs.items()}


def inputs(key: StageKey, recipe: Recipe) -> dict[str, Ref]:
    return {"rollout": layout.rollout_ref(key.cycle)}


def outputs(key: StageKey, recipe: Recipe) -> list[Ref]:
    return [layout.teacher_tensors_ref(key.cycle), layout.teacher_score_ref(key.cycle)]


def run(ctx: StageContext, got: dict) -> list[Output]:
    cycle = ctx.key.cycle
    positions, tensors = score(ctx.recipe, ctx.host, got["rollout"], ctx.reporter)
    tensors_out, tensor_file = tensor_output(layout.teacher_tensors_ref(cycle), tensors)
    record = TeacherScore(cycle, ctx.recipe.loss.mode, ctx.digests["rollout"], positions, tensor_file)
    return [tensors_out, artifact_output(layout.teacher_score_ref(cycle), record)]
