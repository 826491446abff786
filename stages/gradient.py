"""Gradient: the whole optimizer group's adapter gradient, chunked over the vocabulary loss.

objective = (1 / M) * sum over every model-generated position of the cycle of
loss_i, where M is the number of such positions in the whole group. Each
micro-batch of `trajectory_batch_size` trajectories adds its share into the
same `.grad`, so the micro-batch size changes execution, never the objective.

On an out-of-memory error the stage is retried from scratch with half the
loss chunk size, down to `memory.min_chunk_size`; nothing else ever changes.

reads cycle k's rollout and teacher scores and policy checkpoint k; writes
cycles/k/gradient.safetensors and the Gradient record (loss, KL, norm, the
chunk size that succeeded and every attempt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miniverl.engine.core import layout
from miniverl.engine.core.artifacts import ChunkAttempt, CycleSummary, Gradient, Rollout
from miniverl.engine.core.device import offloads_activations, uses_fused_kernels
from miniverl.engine.core.errors import ArtifactError, StageFailed
from miniverl.engine.core.layout import Ref, StageKey
from miniverl.engine.core.faults import oom_guard
from miniverl.engine.distill.losses import LossSpec, LossStats, PositionTargets, chunked_loss_backward
from miniverl.engine.models.host import ModelHost
from miniverl.engine.models.loading import adapter_parameters, decoder_and_head, set_gradient_checkpointing
from miniverl.engine.core.progress import Reporter
from miniverl.engine.core.recipe import Recipe
from miniverl.engine.models.lora_branch import lean_lora
from miniverl.engine.models.sequences import micro_batches, predicting_hidden
from miniverl.engine.models.training_kernels import fused_training_ops
from miniverl.stages.contract import Output, StageContext, artifact_output, checkpoint_inputs, tensor_output

NAME = layout.GRADIENT


@dataclass(frozen=True)
class GroupGradient:
    grads: dict[str, torch.Tensor]  # adapter parameter name -> gradient of the group objective
    stats: LossStats
    micro_batches: int
    chunk_size: int  # the one that succeeded
    attempts: list[ChunkAttempt]

    @property
    def norm(self) -> float:
        """Global L2 norm before clipping, accumulated in float64."""
        return float(torch.sqrt(sum((g.double() ** 2).sum() for g in self.grads.values())))


def _targets(mode: str, tokens_N: torch.Tensor, teacher: dict[str, torch.Tensor], lo: int, hi: int,
             teacher_head_VH: torch.Tensor | None, device: str) -> PositionTargets:
    def part(name: str) -> torch.Tensor:
        return teacher[name][lo:hi].to(device)

    if mode == "sampled_kl":
        return PositionTargets(tokens_N, teacher_logprobs_N=part("teacher_logprobs"))
    if mode == "topk_tail":
        return PositionTargets(tokens_N, topk_ids_NK=part("topk_ids"), topk_logprobs_NK=part("topk_logprobs"))
    # The teacher's hidden states stay in host memory; the loss moves one chunk at a time (12 MB less on
    # the device through the backward at 6 x 704 tokens of Qwen3-1.7B).
    return PositionTargets(tokens_N, teacher_hidden_NH=teacher["teacher_hidden"][lo:hi], teacher_head_VH=teacher_head_VH)


def _one_pass(recipe: Recipe, host: ModelHost, rollout: Rollout, teacher: dict[str, torch.Tensor],
              chunk_size: int, reporter: Reporter) -> tuple[dict[str, torch.Tensor], LossStats, int]:
    spec = LossSpec(recipe.loss.mode, recipe.loss.divergence, recipe.loss.jsd_beta)
    student = host.student()
    params = adapter_parameters(student)
    for p in params.values():
        p.grad = None
    teacher_head = host.teacher_head() if spec.mode == "exact" else None
    body, head_VH = decoder_and_head(student)
    total_positions = sum(len(t.sampling_logprobs) for t in rollout.trajectories)
    totals = LossStats(0.0, 0.0, 0, 0)
    offset = 0
    batches = micro_batches(rollout.trajectories, recipe.train.trajectory_batch_size)
    with reporter.bar(f"cycle {rollout.cycle} gradient (chunk {chunk_size})", len(batches), "micro-batches") as advance, \
            _HostGradients(params) as summed:
        for batch in batches:
            with torch.enable_grad():
                hidden_NH, tokens_N = predicting_hidden(body, batch, host.tokenizer.pad_token_id, host.device)
                n = hidden_NH.shape[0]
                targets = _targets(spec.mode, tokens_N, teacher, offset, offset + n, teacher_head, host.device)
                stats = chunked_loss_backward(hidden_NH, head_VH, targets, spec, chunk_size,
                                              float(max(total_positions, 1)), host.vocab_limit, oom_guard,
                                              consume_hidden=True)
            offset += n
            summed.collect()
            totals = LossStats(totals.loss_sum + stats.loss_sum, totals.kl_sum + stats.kl_sum,
                               totals.positions + stats.positions, totals.chunks + stats.chunks)
            advance(1)
    grads = {name: total.float() for name, total in summed.sums.items()}
    return grads, totals, len(batches)


class _HostGradients:
    """Each adapter gradient leaves the device as soon as the backward has made it, summed in host float64.

    A post-accumulate hook copies the fresh `.grad` into pinned host memory (asynchronously, on the
    compute stream) and drops it, so the device never holds the whole adapter's gradient: 40 MB at LoRA
    r16 on Qwen3-0.6B, at the gradient stage's peak. `collect` waits for the copies and adds them in
    float64: the micro-batches' float32 sum would depend on how the group is split, and so would the
    update."""

    def __init__(self, params: dict[str, torch.nn.Parameter]):
        self.params = params
        self.sums = {name: torch.zeros(p.shape, dtype=torch.float64) for name, p in params.items()}
        self._staged: list[tuple[str, torch.Tensor]] = []
        self._handles: list = []

    def _hook(self, name: str):
        def to_host(param: torch.nn.Parameter) -> None:
            grad = param.grad
            staged = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=grad.is_cuda)
            staged.copy_(grad, non_blocking=grad.is_cuda)
            self._staged.append((name, staged))
            param.grad = None
        return to_host

    def __enter__(self) -> "_HostGradients":
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(n)) for n, p in self.params.items()]
        return self

    def collect(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for name, staged in self._staged:
            self.sums[name] += staged.double()
        self._staged.clear()

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._staged.clear()


def compute(recipe: Recipe, host: ModelHost, rollout: Rollout, teacher: dict[str, torch.Tensor],
            adapter: dict[str, torch.Tensor], reporter: Reporter, on_retry=None) -> GroupGradient:
    """The group gradient, retried with a halved chunk size after each OOM."""
    student = host.student(adapter)
    student.train()
    if recipe.train.gradient_checkpointing:
        set_gradient_checkpointing(student, True, offload=offloads_activations(recipe, host.device))
    chunk_size = recipe.loss.chunk_size
    attempts: list[ChunkAttempt] = []
    try:
        while True:
            try:
                with fused_training_ops(student, uses_fused_kernels(recipe, host.device)), lean_lora(student):
                    grads, stats, n_micro = _one_pass(recipe, host, rollout, teacher, chunk_size, reporter)
                attempts.append(ChunkAttempt(chunk_size, True, None))
                return GroupGradient(grads, stats, n_micro, chunk_size, attempts)
            except torch.OutOfMemoryError as exc:
                attempts.append(ChunkAttempt(chunk_size, False, str(exc).splitlines()[0][:200]))
                for p in adapter_parameters(host.student()).values():
                    p.grad = None
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                smaller = chunk_size // 2
                if smaller < recipe.memory.min_chunk_size:
                    raise StageFailed(
                        f"gradient stage ran out of memory at loss.chunk_size {chunk_size} and may not go below "
                        f"memory.min_chunk_size {recipe.memory.min_chunk_size}; see the OOM guide in the README"
                    ) from None
                if on_retry is not None:
                    on_retry(chunk_size, smaller, attempts[-1].error)
                chunk_size = smaller
    finally:
        if recipe.train.gradient_checkpointing:
            set_gradient_checkpointing(student, False)
        student.eval()


def inputs(key: StageKey, recipe: Recipe) -> dict[str, Ref]:
    return {"rollout": layout.rollout_ref(key.cycle), "scores": layout.teacher_score_ref(key.cycle),
            "teacher": layout.teacher_tensors_ref(key.cycle), **checkpoint_inputs(key.cycle)}


def outputs(key: StageKey, recipe: Recipe) -> list[Ref]:
    return [layout.gradient_tensors_ref(key.cycle), layout.gradient_ref(key.cycle)]


def run(ctx: StageContext, got: dict) -> list[Output]:
    cycle = ctx.key.cycle
    if got["scores"].rollout_sha256 != ctx.digests["rollout"]:
        raise ArtifactError(f"teacher scores of cycle {cycle} belong to another rollout; rerun teacher_score")
    result = compute(ctx.recipe, ctx.host, got["rollout"], got["teacher"], got["adapter"], ctx.reporter, ctx.on_oom_retry)
    tensors_out, tensor_file = tensor_output(layout.gradient_tensors_ref(cycle), result.grads)
    positions = max(result.stats.positions, 1)
    record = Gradient(cycle, got["checkpoint"].adapter_sha256, tensor_file, result.stats.loss_sum / positions,
                      result.stats.kl_sum / positions, result.stats.positions, result.micro_batches,
                      result.chunk_size, result.attempts, result.norm)
    return [tensors_out, artifact_output(layout.gradient_ref(cycle), record, CycleSummary.of(record))]
