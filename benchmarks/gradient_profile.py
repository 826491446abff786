"""Where the gradient and optimizer stages spend their time, and what each stage's memory grows with.

    python3 benchmarks/gradient_profile.py --out benchmarks/results/gradient_profile_h200.json

At the real Qwen3 shapes (random weights, `qwen_assets.build_assets`; the calc
recipe: NF4 Qwen3-0.6B + LoRA r16 on all seven projections, bf16 Qwen3-1.7B
teacher), on one CUDA GPU:

1. `loss`: the exact reverse-KL loss alone over 3,200 positions (student H 1024,
   teacher H 2048, 151,936 head rows, 151,669 real): the unfused chunked loss,
   the fused Triton one (`engine/distill/fused_exact.py`), a naive full-logits
   one and, if installed, liger-kernel's fused linear JSD; seconds (best of 3),
   peak bytes above the start, and the hidden-state gradient's distance to the
   naive one's.
2. `gradient`: `stages.gradient.compute` on 6 synthetic trajectories of 704
   tokens at micro-batch 1/2/6, chunk 16 unfused (as shipped) and chunk 256
   fused, split into forward, loss, backward and the rest with synchronised
   timers, plus a torch.profiler table for two of them.
3. `memory`: peak allocated above the resident weights for rollout (generation
   batch 1/4/8), teacher_score (micro-batch 1/2/6) and gradient, the figures the
   memory plan's estimate must cover.
4. `optimizer`: `stages.optimizer_step.step` (cold and warm) and the checkpoint's
   serialisation and write.
5. `offload`: pinning the teacher's body in host memory and copying it back.

`--smoke` runs the same code on tiny CPU models, to check the script here.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))

GIB = 2**30


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def sync() -> None:
    import torch

    if cuda():
        torch.cuda.synchronize()


def measured(fn, repeats: int = 1) -> dict:
    """Best and median seconds over `repeats` calls, and the peak bytes above the start (CUDA)."""
    import torch

    times, peak, result = [], 0, None
    for _ in range(repeats):
        gc.collect()
        sync()
        if cuda():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda() else 0
        started = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - started)
        if cuda():
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
    return {"seconds": min(times), "median_seconds": statistics.median(times), "peak_extra_bytes": peak,
            "result": result}


class Timers:
    """Synchronised wall time per named part, summed over calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def part(self, name: str):
        sync()
        started = time.perf_counter()
        try:
            yield
        finally:
            sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started


# ----------------------------------------------------------------------------- 1. the loss alone


def loss_variants(host, positions: int, device: str) -> dict:
    import torch

    from miniverl.engine.distill.losses import LossSpec, PositionTargets, chunked_loss_backward, fused_exact_applies
    from miniverl.engine.models.loading import decoder_and_head

    _, head = decoder_and_head(host.student())
    teacher_head = host.teacher_head()
    v = host.vocab_limit
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = (torch.randn(positions, head.shape[1], generator=gen, device=device) * 2).to(head.dtype)
    t_hidden = (torch.randn(positions, teacher_head.shape[1], generator=gen, device=device) * 2).to(head.dtype)
    targets = PositionTargets(torch.zeros(positions, dtype=torch.long, device=device), teacher_hidden_NH=t_hidden,
                              teacher_head_VH=teacher_head)
    spec = LossSpec("exact", "reverse_kl")
    out: dict = {"positions": positions, "student_head": list(head.shape), "teacher_head": list(teacher_head.shape),
                 "vocab_limit": v, "fused_applies": fused_exact_applies(head, targets, spec)}

    def chunked(chunk: int, fused: bool):
        def run():
            h = hidden.clone().requires_grad_(True)
            chunked_loss_backward(h, head, targets, spec, chunk, float(positions), v, fused=fused)
            return h.grad
        return run

    def naive():
        h = hidden.clone().requires_grad_(True)
        logits = (h @ head[:v].T).float()
        with torch.no_grad():
            logp_t = torch.log_softmax((t_hidden @ teacher_head[:v].T).float(), dim=-1)
        logp_s = torch.log_softmax(logits, dim=-1)
        ((logp_s.exp() * (logp_s - logp_t)).sum() / positions).backward()
        return h.grad

    reference = measured(naive, 3)
    out["naive"] = {k: v_ for k, v_ in reference.items() if k != "result"}
    want = reference["result"].double()
    variants = [("unfused", c, False) for c in (16, 64, 256)]
    if out["fused_applies"]:
        variants += [("fused", c, True) for c in (64, 128, 256, 512, 1024)]
    for name, chunk, fused in variants:
        got = measured(chunked(chunk, fused), 3)
        out[f"{name}_{chunk}"] = {**{k: v_ for k, v_ in got.items() if k != "result"},
                                  "grad_rel_diff_to_naive": float((got["result"].double() - want).norm() / want.norm())}
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD

        jsd = LigerFusedLinearJSD(jsd_beta=1.0)

        def liger():
            h = hidden.clone().requires_grad_(True)
            jsd(h, head[:v], t_hidden, teacher_head[:v], None).backward()
            return h.grad

        got = measured(liger, 3)
        out["liger_fused_linear_jsd_beta1"] = {
            **{k: v_ for k, v_ in got.items() if k != "result"},
            "grad_rel_diff_to_naive": float((got["result"].double() - want).norm() / want.norm())}
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal: liger is optional
        out["liger_fused_linear_jsd_beta1"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return out


# ----------------------------------------------------------------------------- 2. the gradient stage, in parts


def gradient_parts(recipe, host, rollout, scores, adapter, micro: int, chunk: int, fused: bool,
                   profile: bool = False) -> dict:
    import msgspec
    import torch

    from miniverl.engine.core.progress import Reporter
    from miniverl.engine.distill import losses
    from miniverl.engine.models import sequences
    from miniverl.stages import gradient

    variant = msgspec.structs.replace(
        recipe, train=msgspec.structs.replace(recipe.train, trajectory_batch_size=micro),
        loss=msgspec.structs.replace(recipe.loss, chunk_size=chunk),
        memory=msgspec.structs.replace(recipe.memory, min_chunk_size=min(chunk, recipe.memory.min_chunk_size)))
    timers = Timers()
    real_hidden, real_loss, real_backward = gradient.predicting_hidden, gradient.chunked_loss_backward, torch.autograd.backward

    def timed_hidden(*args, **kwargs):
        with timers.part("forward"):
            return real_hidden(*args, **kwargs)

    def timed_backward(*args, **kwargs):
        with timers.part("backward"):
            return real_backward(*args, **kwargs)

    def timed_loss(*args, **kwargs):
        kwargs["fused"] = fused
        with timers.part("loss_and_backward"):
            return real_loss(*args, **kwargs)

    gradient.predicting_hidden, gradient.chunked_loss_backward, torch.autograd.backward = \
        timed_hidden, timed_loss, timed_backward
    try:
        quiet = Reporter(enabled=False)
        gradient.compute(variant, host, rollout, scores, adapter, quiet)  # warm-up
        timers.seconds.clear()
        got = measured(lambda: gradient.compute(variant, host, rollout, scores, adapter, quiet))
        parts = dict(timers.seconds)  # before the profiled call adds to them
        table = None
        if profile and cuda():
            from torch.profiler import ProfilerActivity, profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                gradient.compute(variant, host, rollout, scores, adapter, quiet)
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    finally:
        gradient.predicting_hidden, gradient.chunked_loss_backward, torch.autograd.backward = \
            real_hidden, real_loss, real_backward
    del sequences, losses
    parts["loss"] = parts.pop("loss_and_backward", 0.0) - parts.get("backward", 0.0)
    parts["rest"] = got["seconds"] - sum(parts.values())
    return {"micro_batch": micro, "chunk_size": chunk, "fused": fused, "seconds": got["seconds"],
            "peak_extra_bytes": got["peak_extra_bytes"], "parts_seconds": parts, "profile": table}


def target_grid(recipe, host, rollout, scores, adapter, grid: list[tuple[int, bool, bool]], chunk: int) -> dict:
    """The issue's bar: the exact-mode stage at 6 x 704 tokens against the naive full-logits one (all six
    trajectories at once, float32 [T, V] logits, checkpointing as the recipe), each variant's seconds (best
    of 3 after a warm-up), its peak above the weights, and its gradient's distance to the first variant's.
    `grid`: (micro-batch, offload_activations, fused_kernels) tuples."""
    import msgspec
    import torch

    from qwen_pipeline import naive_gradient
    from miniverl.engine.core.progress import Reporter
    from miniverl.stages import gradient

    quiet = Reporter(enabled=False)
    naive_gradient(host, rollout, scores["teacher_hidden"], adapter, True)  # warm-up
    naive = measured(lambda: naive_gradient(host, rollout, scores["teacher_hidden"], adapter, True), 3)
    out: dict = {"naive": {"seconds": naive["seconds"], "median_seconds": naive["median_seconds"],
                           "peak_extra_bytes": naive["peak_extra_bytes"]}, "runs": []}
    reference = None
    for micro, offload, fused in grid:
        if fused and not cuda():
            continue
        variant = msgspec.structs.replace(
            recipe, train=msgspec.structs.replace(recipe.train, trajectory_batch_size=micro,
                                                  offload_activations=offload, fused_kernels=fused),
            loss=msgspec.structs.replace(recipe.loss, chunk_size=chunk))
        gradient.compute(variant, host, rollout, scores, adapter, quiet)  # warm-up
        got = measured(lambda: gradient.compute(variant, host, rollout, scores, adapter, quiet), 3)
        flat = torch.cat([g.flatten().double() for _, g in sorted(got["result"].grads.items())])
        reference = flat if reference is None else reference
        run = {"micro_batch": micro, "offload_activations": offload, "fused_kernels": fused,
               "chunk_size": chunk, "seconds": got["seconds"], "median_seconds": got["median_seconds"],
               "peak_extra_bytes": got["peak_extra_bytes"], "over_naive": got["seconds"] / naive["seconds"],
               "grad_rel_diff_to_first": float((flat - reference).norm() / reference.norm())}
        out["runs"].append(run)
        print(run, flush=True)
    return out


# ----------------------------------------------------------------------------- 3. memory per stage


def stage_memory(recipe, host, task, rollout, adapter) -> dict:
    import msgspec

    from miniverl.engine.core.progress import Reporter
    from miniverl.stages import rollout as rollout_stage
    from miniverl.stages import teacher_score

    quiet = Reporter(enabled=False)
    out: dict = {"rollout": {}, "teacher_score": {}}
    for batch in (1, 4, 8):
        variant = msgspec.structs.replace(
            recipe, train=msgspec.structs.replace(recipe.train, rollouts_per_cycle=batch),
            rollout=msgspec.structs.replace(recipe.rollout, generation_batch_size=batch))
        got = measured(lambda: rollout_stage.sample(variant, host, task, adapter, "profile", 0, quiet))
        tokens = [len(t.token_ids) for t in got["result"].trajectories]
        out["rollout"][batch] = {"seconds": got["seconds"], "peak_extra_bytes": got["peak_extra_bytes"],
                                 "tokens": tokens}
    for micro in (1, 2, 6):
        variant = msgspec.structs.replace(recipe, train=msgspec.structs.replace(recipe.train,
                                                                                trajectory_batch_size=micro))
        got = measured(lambda: teacher_score.score(variant, host, rollout, quiet))
        out["teacher_score"][micro] = {"seconds": got["seconds"], "peak_extra_bytes": got["peak_extra_bytes"]}
    return out


# ----------------------------------------------------------------------------- 4. the optimizer step


def optimizer_parts(recipe, host, adapter, device: str, optimizer: str) -> dict:
    import torch

    from miniverl.engine.core.atomic_io import write_bytes_atomic
    from miniverl.stages.contract import checkpoint_outputs
    from miniverl.stages.optimizer_step import step

    gen = torch.Generator().manual_seed(1)
    grads = {n: torch.randn(t.shape, generator=gen) * 1e-3 for n, t in adapter.items()}
    out: dict = {"parameters": sum(t.numel() for t in adapter.values()), "tensors": len(adapter)}
    cold = measured(lambda: step(recipe, optimizer, device, adapter, {}, {}, grads))
    new, tensors, scalars = cold["result"]
    warm = measured(lambda: step(recipe, optimizer, device, new, tensors, scalars, grads))
    new2, tensors2, scalars2 = warm["result"]
    out["step_cold_seconds"], out["step_warm_seconds"] = cold["seconds"], warm["seconds"]
    serial = measured(lambda: checkpoint_outputs(2, recipe, "0" * 64, new2, tensors2, scalars2))
    out["serialise_seconds"] = serial["seconds"]
    outputs = serial["result"]
    with tempfile.TemporaryDirectory() as tmp:
        def write():
            for index, output in enumerate(outputs):
                data = getattr(output, "data", None)
                if isinstance(data, bytes):
                    write_bytes_atomic(Path(tmp) / f"{index}.bin", data)
        out["write_seconds"] = measured(write)["seconds"]
    out["bytes"] = sum(len(getattr(o, "data", b"") or b"") for o in outputs)
    # The step's own pieces, warm: optimizer construction + state restore, the update, the state's flattening.
    from miniverl.stages import optimizer_step as opt

    names = sorted(new2)
    timers = Timers()
    with timers.part("to_device"):
        params = [torch.nn.Parameter(new2[n].to(device=device, dtype=torch.float32).clone()) for n in names]
    with timers.part("make_optimizer_and_restore"):
        optimizer_obj = opt.make_optimizer(optimizer, params, recipe)
        opt.restore_state(optimizer_obj, tensors2, scalars2)
    with timers.part("grads_to_device_and_clip"):
        for name, param in zip(names, params):
            param.grad = grads[name].to(device=device, dtype=torch.float32).clone()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False)
    with timers.part("update"):
        optimizer_obj.step()
    with timers.part("flatten_state"):
        opt.flatten_state(optimizer_obj)
    out["warm_parts_seconds"] = timers.seconds
    return out


# ----------------------------------------------------------------------------- 5. offload


def offload_cost(host) -> dict:
    import torch

    if not cuda():
        return {"skipped": "no CUDA"}
    from miniverl.engine.models.loading import decoder_and_head

    teacher = host.teacher()
    _, head = decoder_and_head(teacher)
    body = [p for p in teacher.parameters() if p.data_ptr() != head.data_ptr()]
    nbytes = sum(p.numel() * p.element_size() for p in body)
    timers = Timers()
    with timers.part("pin_copy"):
        pinned = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p.data, non_blocking=True) for p in body]
    device_data = [p.data for p in body]
    with timers.part("release"):
        for p, h in zip(body, pinned):
            p.data = h
        del device_data
        torch.cuda.empty_cache()
    with timers.part("reload"):
        for p, h in zip(body, pinned):
            p.data = h.to("cuda", non_blocking=True)
    return {"body_bytes": nbytes, "seconds": timers.seconds,
            "reload_gb_per_s": nbytes / timers.seconds["reload"] / 1e9}


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gradient_profile"))
    parser.add_argument("--smoke", action="store_true", help="tiny CPU models: check the script, measure nothing")
    parser.add_argument("--skip", action="append", default=[], choices=("loss", "gradient", "memory", "optimizer",
                                                                         "offload", "target"))
    parser.add_argument("--target-micro", type=int, action="append", default=[],
                        help="micro-batch sizes of the target grid (default 3, 6)")
    parser.add_argument("--target-chunk", type=int, default=256, help="the target grid's loss.chunk_size")
    args = parser.parse_args(argv)
    import torch
    import yaml

    from qwen_pipeline import environment, synthetic_rollout
    from miniverl.engine.core.device import resolve_all
    from miniverl.engine.core.recipe import load_recipe
    from miniverl.engine.models.host import ModelHost
    from miniverl.engine.tasks.calculator import CalculatorTask

    args.work.mkdir(parents=True, exist_ok=True)
    data = yaml.safe_load((ROOT / "recipes" / "qwen_consumer_gpu_calc.yaml").read_text())
    if args.smoke:
        from qwen3_fixture import make_model_dir

        dirs = {"student": make_model_dir(args.work / "s", tiny=True, hidden_size=64, seed=0),
                "teacher": make_model_dir(args.work / "t", tiny=True, hidden_size=96, seed=1)}
        data["models"]["student"]["quantization"] = "none"
        data["models"]["device"] = "cpu"
        tokens, positions = 320, 64
    else:
        from qwen_assets import build_assets

        assets = build_assets(args.work, ("calc",))
        dirs = {"student": assets["dirs"]["qwen3-0.6b"], "teacher": assets["dirs"]["qwen3-1.7b"]}
        tokens, positions = data["rollout"]["max_total_tokens"], 3200
    for role in ("student", "teacher"):
        data["models"][role]["path"] = str(dirs[role])
    data["rollout"]["max_total_tokens"] = tokens
    # Each section sets its own batch sizes; the shipped `auto`s are resolved by a run's plan, not here.
    data["train"]["trajectory_batch_size"] = data["rollout"]["generation_batch_size"] = 1
    data["loss"]["chunk_size"] = 16
    data["rollout"]["max_new_tokens_per_turn"] = min(data["rollout"]["max_new_tokens_per_turn"], tokens)
    path = args.work / "calc.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    recipe, _ = load_recipe(path)
    resolved = resolve_all(recipe)
    device, dtype = resolved["device"].value, resolved["dtype"].value
    host = ModelHost(recipe, device, dtype, "resident")
    result: dict = {"command": "python3 " + " ".join(sys.argv), "environment": environment() if cuda() else {},
                    "device": device, "dtype": dtype}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))

    host.student()
    weights_student = torch.cuda.memory_allocated() if cuda() else 0
    host.teacher()
    result["weights_bytes"] = {"student": weights_student,
                               "both": torch.cuda.memory_allocated() if cuda() else 0}
    adapter = {n: t.cpu() for n, t in host.initial_adapter().items()}
    gen = torch.Generator().manual_seed(3)
    adapter = {n: t + 0.01 * torch.randn(t.shape, generator=gen) if "lora_B" in n else t for n, t in adapter.items()}
    if "loss" not in args.skip:
        result["loss"] = loss_variants(host, positions, device)
        save()
    rollout = synthetic_rollout(host, 6, tokens)
    from miniverl.engine.core.progress import Reporter
    from miniverl.stages import teacher_score

    _, scores = teacher_score.score(recipe, host, rollout, Reporter(enabled=False))
    if "target" not in args.skip:
        grid = [(m, o, f) for m in args.target_micro or [3, 6] for o in (False, True) for f in (False, True)]
        result["target"] = target_grid(recipe, host, rollout, scores, adapter, grid, args.target_chunk)
        save()
    if "gradient" not in args.skip:
        runs = [(1, 16, False, True), (2, 16, False, False), (6, 16, False, False)]
        if cuda():
            runs += [(1, 256, True, False), (2, 256, True, False), (4, 256, True, False), (6, 256, True, True),
                     (6, 512, True, False)]
        result["gradient"] = [gradient_parts(recipe, host, rollout, scores, adapter, m, c, f, p) for m, c, f, p in runs]
        save()
    if "memory" not in args.skip:
        result["memory"] = stage_memory(recipe, host, CalculatorTask(), rollout, adapter)
        save()
    if "optimizer" not in args.skip:
        result["optimizer"] = optimizer_parts(recipe, host, adapter, device, resolved["optimizer.name"].value)
        save()
    if "offload" not in args.skip:
        result["offload"] = offload_cost(host)
    save()
    print(json.dumps({k: v for k, v in result.items() if k != "gradient"}, indent=1, default=str)[:6000])
    for g in result.get("gradient", []):
        print({k: v for k, v in g.items() if k != "profile"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
