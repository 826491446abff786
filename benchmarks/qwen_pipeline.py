"""Peak memory and time of the two Qwen3 recipes at the real shapes, on one CUDA GPU.

    python3 benchmarks/qwen_pipeline.py --out benchmarks/results/qwen_pipeline_h200.json

No hub: the models are built locally with random weights from the published
Qwen3-0.6B and Qwen3-1.7B configurations and saved with Qwen3's real tokenizer
files (`tests/fixtures/qwen3/`; both model directories hold byte-identical
tokenizer files). Then, through the real CLI:

1. `recipes/qwen_consumer_gpu_calc.yaml` (NF4 0.6B student + LoRA, bf16 1.7B
   teacher, dual_model) runs a few cycles at its real token budgets, is
   SIGKILLed inside cycle 1's gradient stage (MINIVERL_FAULT_KILL_AT) and
   resumed to the end;
2. `recipes/qwen_consumer_gpu_shared.yaml` (one NF4 0.6B base, a random
   frozen teacher adapter and the student adapter, batch 4) runs the same way
   without the kill.

Random weights never emit <|im_end|>, so every trajectory runs to the 704-token
budget: the worst case. Only the number of cycles, rollouts per cycle and
held-out tasks is reduced (recorded under "overrides"); every token budget,
batch size, chunk size and strategy is the shipped recipe's.

A separate process then measures, for each recipe, the weights each model
holds on the GPU and the `exact` gradient stage on 6 trajectories of 704
tokens next to a naive full-logits implementation (student and teacher
[T, V] float32 logits, log-softmax, KL, backward), both as peak memory above
the memory allocated before they start.

Writes the JSON result and a Markdown report next to it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen_assets import build_assets  # noqa: E402
from qwen_pipeline_markdown import markdown  # noqa: E402

GIB = 2**30
KILL_POINT = "c000001/gradient:inputs-read"
BASES: list[int] = []  # memory allocated when each measured call started


# ----------------------------------------------------------------------------- recipes and runs


def set_key(data: dict, dotted: str, value) -> None:
    node = data
    keys = dotted.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value


def write_recipe(shipped: str, overrides: dict, path: Path) -> Path:
    import yaml

    data = yaml.safe_load((ROOT / "recipes" / shipped).read_text())
    for dotted, value in overrides.items():
        set_key(data, dotted, value)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def cli(args: list[str], log: Path, env_extra: dict | None = None, timeout: float = 900,
        python_args: tuple[str, ...] = ()) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINIVERL_FAULT")}
    env.update({"PYTHONUNBUFFERED": "1", **(env_extra or {})})
    started = time.perf_counter()
    with open(log, "a", encoding="utf-8") as handle:
        handle.write(f"\n$ miniverl {' '.join(args)}  {env_extra or ''}\n")
        handle.flush()
        try:
            rc = subprocess.run([sys.executable, *python_args, "-m", "miniverl.engine.cli.app", *args], stdout=handle,
                                stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return {"args": args, "env": env_extra or {}, "rc": rc, "seconds": round(time.perf_counter() - started, 1)}


def stage_table(run_dir: Path) -> list[dict]:
    """The last stage_end event of every stage (a resumed stage reports its final attempt)."""
    ends: dict[str, dict] = {}
    retries: dict[str, list] = {}
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "stage_end":
            ends[event["stage"]] = event
        elif event["event"] == "oom_retry":
            retries.setdefault(event["stage"], []).append([event["chunk_size"], event["next_chunk_size"]])
    return [{"stage": stage, "seconds": e["seconds"], "peak_allocated_gib": e["peak_memory_bytes"] / GIB,
             "peak_reserved_gib": e.get("peak_reserved_bytes", 0) / GIB, "oom_retries": retries.get(stage, [])}
            for stage, e in ends.items()]


def run_pipeline(recipe: Path, run_id: str, runs: Path, log: Path, kill: bool, timeout: float) -> dict:
    steps = []
    started = time.perf_counter()
    if kill:
        steps.append(cli(["run", str(recipe), "--run-id", run_id, "--runs-dir", str(runs)], log,
                         {"MINIVERL_FAULT_KILL_AT": KILL_POINT}, timeout))
        steps.append(cli(["resume", run_id, "--runs-dir", str(runs)], log,
                         timeout=max(timeout - (time.perf_counter() - started), 10)))
    else:
        steps.append(cli(["run", str(recipe), "--run-id", run_id, "--runs-dir", str(runs)], log, timeout=timeout))
    run_dir = runs / run_id
    result: dict = {"commands": steps}
    if (run_dir / "events.jsonl").is_file():
        result["stages"] = stage_table(run_dir)
    manifest_path = run_dir / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        journal_attempts = {k: v["attempts"] for k, v in manifest["stages"].items()}
        result.update({
            "completed": manifest["status"] == "completed",
            "resolved": manifest["resolved"],
            "environment": manifest["environment"],
            "trainable_parameters": manifest["adapter"]["trainable_parameters"],
            "teacher_adapter": manifest["adapter"].get("teacher_adapter"),
            "chunk_sizes_used": manifest["chunk_sizes_used"],
            "cycles": [{k: c.get(k) for k in ("cycle", "loss", "kl", "positions", "grad_norm", "chunk_size",
                                              "micro_batches", "attempts")} for c in manifest["cycles"]],
            "oom_retries": manifest["oom_retries"],
            "stage_attempts": journal_attempts,
        })
        if kill:
            result["resume"] = {
                "killed_at": KILL_POINT, "kill_rc": steps[0]["rc"], "resume_rc": steps[1]["rc"],
                "killed_stage_attempts": journal_attempts.get(KILL_POINT.split(":")[0]),
            }
    rollout = sorted(run_dir.glob("cycles/*/rollout.msgpack"))
    if rollout:
        result["trajectory_tokens"] = _trajectory_lengths(rollout[0])
    return result


def _trajectory_lengths(path: Path) -> dict:
    from miniverl.engine.core.artifacts import Rollout, read_artifact

    artifact = read_artifact(path, Rollout)
    return {"total": [len(t.token_ids) for t in artifact.trajectories],
            "prompt": [t.provenance.count(0) for t in artifact.trajectories],
            "finish": [t.finish_reason for t in artifact.trajectories]}


# ----------------------------------------------------------------------------- the gradient-stage comparison


def synthetic_rollout(host, n: int, total_tokens: int):
    """n trajectories of exactly `total_tokens`: a real calculator prompt, then random model tokens."""
    import torch

    from miniverl.engine.core.artifacts import Rollout, Trajectory
    from miniverl.engine.tasks.calculator import CalculatorTask
    from miniverl.engine.tasks.protocol import render_prompt

    gen = torch.Generator().manual_seed(0)
    trajectories = []
    calculator = CalculatorTask()
    for task in calculator.items("train", n, seed=12345):
        prompt = host.tokenizer(render_prompt(host.tokenizer, calculator, task), add_special_tokens=False).input_ids
        model = torch.randint(0, host.vocab_limit, (total_tokens - len(prompt),), generator=gen).tolist()
        trajectories.append(Trajectory(
            task_id=task.task_id, question=task.question, answer=task.answer,
            token_ids=prompt + model, provenance=[0] * len(prompt) + [1] * len(model),
            sampling_logprobs=[-12.0] * len(model), turns=[""], tool_results=[], tool_ok=[],
            finish_reason="length", tool_called=False, format_valid=False, strict_success=False))
    return Rollout(cycle=0, policy_adapter_sha256="synthetic", temperature=1.0, top_p=1.0,
                   trajectories=trajectories, generated_tokens=sum(len(t.sampling_logprobs) for t in trajectories))


def _measured(fn):
    """(result, seconds, peak bytes above what was allocated when fn started); the start is kept in BASES."""
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    started = time.perf_counter()
    BASES.append(base)
    result = fn()
    torch.cuda.synchronize()
    return result, time.perf_counter() - started, torch.cuda.max_memory_allocated() - base


def naive_gradient(host, rollout, teacher_hidden_NH, adapter, checkpointing: bool):
    """Full [T, V] float32 logits for student and teacher, log-softmax, reverse KL, backward."""
    import torch

    from miniverl.engine.models.loading import adapter_parameters, decoder_and_head, set_gradient_checkpointing
    from miniverl.engine.models.sequences import predicting_hidden

    student = host.student(adapter)
    student.train()
    if checkpointing:
        set_gradient_checkpointing(student, True)
    body, head_VH = decoder_and_head(student)
    teacher_head_VH = host.teacher_head()
    v = host.vocab_limit
    try:
        with torch.enable_grad():
            hidden_NH, _ = predicting_hidden(body, rollout.trajectories, host.tokenizer.pad_token_id, host.device)
            logits_NV = (hidden_NH @ head_VH[:v].T).float()
            with torch.no_grad():
                teacher_logits_NV = (teacher_hidden_NH.to(host.device) @ teacher_head_VH[:v].T).float()
                logp_t_NV = torch.log_softmax(teacher_logits_NV, dim=-1)
            logp_s_NV = torch.log_softmax(logits_NV, dim=-1)
            kl = (logp_s_NV.exp() * (logp_s_NV - logp_t_NV)).sum(-1).sum() / hidden_NH.shape[0]
            kl.backward()
        grads = {n: p.grad.detach().float().cpu().clone() for n, p in adapter_parameters(student).items()}
    finally:
        for p in adapter_parameters(student).values():
            p.grad = None
        if checkpointing:
            set_gradient_checkpointing(student, False)
        student.eval()
    return grads, float(kl.detach())


def measure(recipe_path: Path, out: Path, trajectories: int) -> None:
    import msgspec
    import torch

    from miniverl.engine.core.device import resolve_all
    from miniverl.engine.models.host import ModelHost
    from miniverl.engine.core.progress import Reporter
    from miniverl.engine.core.recipe import load_recipe
    from miniverl.stages import gradient, teacher_score

    quiet = Reporter(enabled=False)
    recipe, _ = load_recipe(recipe_path)
    resolved = resolve_all(recipe)
    host = ModelHost(recipe, "cuda", resolved["dtype"].value, resolved["memory.strategy"].value)
    m0 = torch.cuda.memory_allocated()
    host.student()
    m1 = torch.cuda.memory_allocated()
    host.teacher()
    m2 = torch.cuda.memory_allocated()
    adapter = {n: t.cpu() for n, t in host.initial_adapter().items()}
    # LoRA B starts at zero (A would get no gradient): perturb it so both matter.
    gen = torch.Generator().manual_seed(3)
    adapter = {n: t + 0.01 * torch.randn(t.shape, generator=gen) if "lora_B" in n else t for n, t in adapter.items()}
    rollout = synthetic_rollout(host, trajectories, recipe.rollout.max_total_tokens)
    (_, scores), score_s, score_peak = _measured(lambda: teacher_score.score(recipe, host, rollout, quiet))
    chunked, chunked_s, chunked_peak = _measured(
        lambda: gradient.compute(recipe, host, rollout, scores, adapter, quiet))
    (naive, naive_kl), naive_s, naive_peak = _measured(
        lambda: naive_gradient(host, rollout, scores["teacher_hidden"], adapter, recipe.train.gradient_checkpointing))
    # The stage at other chunk sizes: what loss.chunk_size buys (peak above the start, seconds).
    by_chunk = {}
    for chunk in (64, 32, 16, 8):
        variant = msgspec.structs.replace(recipe, loss=msgspec.structs.replace(recipe.loss, chunk_size=chunk),
                                          memory=msgspec.structs.replace(recipe.memory, min_chunk_size=min(chunk, 4)))
        _, seconds, peak = _measured(lambda: gradient.compute(variant, host, rollout, scores, adapter, quiet))
        by_chunk[chunk] = {"peak_extra_bytes": peak, "seconds": seconds}
    grads, stats = chunked.grads, chunked.stats
    flat_c = torch.cat([grads[n].flatten().double() for n in sorted(grads)])
    flat_n = torch.cat([naive[n].flatten().double() for n in sorted(naive)])
    result = {
        "recipe": recipe.name,
        "weights_bytes": {"student": m1 - m0, "teacher": m2 - m1, "total": m2 - m0},
        "trajectories": trajectories,
        "tokens_per_trajectory": recipe.rollout.max_total_tokens,
        "positions": stats.positions,
        "chunk_size": chunked.chunk_size,
        "trajectory_batch_size": recipe.train.trajectory_batch_size,
        "gradient_checkpointing": recipe.train.gradient_checkpointing,
        "teacher_score": {"seconds": score_s, "peak_extra_bytes": score_peak},
        "chunked": {"seconds": chunked_s, "peak_extra_bytes": chunked_peak, "kl": stats.kl_sum / stats.positions,
                    "allocated_before_bytes": BASES[1], "peak_bytes": BASES[1] + chunked_peak},
        "naive": {"seconds": naive_s, "peak_extra_bytes": naive_peak, "kl": naive_kl},
        "naive_over_chunked_peak": naive_peak / chunked_peak,
        "chunked_by_chunk_size": by_chunk,
        "cublas_and_other_before_bytes": BASES[1] - (m2 - m0),
        "gradient_rel_diff": float((flat_c - flat_n).norm() / flat_n.norm()),
    }
    out.write_text(json.dumps(result, indent=2))


# ----------------------------------------------------------------------------- report


def environment() -> dict:
    import torch

    from miniverl.engine.core.device import environment as env

    return {**env(), "torch_cuda": str(torch.version.cuda), "host": platform.node()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    m = sub.add_parser("measure", help="(internal) the gradient-stage comparison in its own process")
    m.add_argument("recipe", type=Path)
    m.add_argument("out", type=Path)
    m.add_argument("--trajectories", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "qwen_pipeline_h200.json")
    parser.add_argument("--work", type=Path, default=Path("/tmp/qwen_pipeline"))
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--calc-rollouts", type=int, default=6)
    parser.add_argument("--shared-rollouts", type=int, default=8)
    parser.add_argument("--only", choices=("calc", "shared"), action="append")
    parser.add_argument("--skip-measure", action="store_true",
                        help="keep the gradient-stage measurement already in --out (with --only)")
    parser.add_argument("--budget", type=float, default=3600.0,
                        help="seconds for the whole benchmark: later phases are skipped (and say so) past it")
    args = parser.parse_args(argv)
    if args.command == "measure":
        measure(args.recipe, args.out, args.trajectories)
        return 0

    work = args.work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log = work / "log.txt"
    begun = time.perf_counter()
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    # `--only` adds to an earlier result file (one recipe per call on a time-limited machine).
    result: dict = json.loads(out.read_text()) if args.only and out.is_file() else {"commands": []}
    result["commands"].append("python3 " + " ".join(sys.argv))
    result.update(environment=environment(), skipped=[])

    def save() -> None:
        out.write_text(json.dumps(result, indent=2, sort_keys=True, default=str))
        out.with_suffix(".md").write_text(markdown(result))

    keys = tuple(args.only or ("calc", "shared"))
    result["assets"] = assets = build_assets(work, keys)
    common = {"train.cycles": args.cycles, "task.heldout_size": 2, "verify.max_new_tokens_per_turn": 32}
    for key in keys:
        result.setdefault("overrides", {})[key] = {**common, "train.rollouts_per_cycle": getattr(args, f"{key}_rollouts")}
    small, large = assets["dirs"]["qwen3-0.6b"], assets["dirs"]["qwen3-1.7b"]
    recipes = {}
    if "calc" in keys:
        recipes["calc"] = write_recipe("qwen_consumer_gpu_calc.yaml", {
            **common, "train.rollouts_per_cycle": args.calc_rollouts,
            "models.student.path": small, "models.teacher.path": large}, work / "calc.yaml")
    if "shared" in keys:
        recipes["shared"] = write_recipe("qwen_consumer_gpu_shared.yaml", {
            **common, "train.rollouts_per_cycle": args.shared_rollouts,
            "models.student.path": small, "models.teacher.path": small,
            "models.teacher.adapter.path": assets["adapter_dir"],
            "models.teacher.adapter.sha256": assets["adapter_sha256"]}, work / "shared.yaml")
    save()

    def left() -> float:
        return args.budget - (time.perf_counter() - begun)

    for key in keys:
        if left() < 60:
            result["skipped"].append(f"{key}: out of the time budget")
            continue
        measured = work / f"measure_{key}.json"
        if args.skip_measure and f"measure_{key}" in result:
            result[key] = run_pipeline(recipes[key], f"qwen-{key}", work / "runs", log, kill=key == "calc",
                                       timeout=left())
            save()
            continue
        try:
            step = subprocess.run([sys.executable, __file__, "measure", str(recipes[key]), str(measured)],
                                  cwd=ROOT, capture_output=True, text=True, timeout=max(left(), 30))
            tail = step.stdout[-5000:] + step.stderr[-5000:]
        except subprocess.TimeoutExpired:
            tail = "timed out"
        with open(log, "a", encoding="utf-8") as handle:
            handle.write(f"\n$ measure {key}\n{tail}")
        result[f"measure_{key}"] = json.loads(measured.read_text()) if measured.is_file() else {"error": tail[-2000:]}
        save()
        if left() < 60:
            result["skipped"].append(f"{key} pipeline: out of the time budget")
            continue
        result[key] = run_pipeline(recipes[key], f"qwen-{key}", work / "runs", log, kill=key == "calc",
                                   timeout=left())
        save()
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
