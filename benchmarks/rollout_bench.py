"""Rollout decode throughput: plain `model.generate` against the CUDA-graph engine, in one process.

    python benchmarks/rollout_bench.py --out-dir benchmarks/results

Model: Qwen3-0.6B's published shape (hidden 1024, 28 layers, 16 heads, 8 kv
heads, head_dim 128, vocab 151936, tied embeddings) with random seeded
weights, loaded through the project's own loader as a bf16 or NF4 student with
its peft LoRA adapter attached, as the rollout stage runs it. Each batch size
decodes the same random prompts with the same budget in both engines: greedy,
no end-of-sequence stop, so every sequence decodes the full budget.

Reported per (weights, batch): tokens/s and trajectories/s end to end (prefill
included, host bookkeeping included), the engine's replayed step time alone,
and the fraction of the bandwidth limit: the bytes a step must read (weights
once, plus the keys and values of the live context) over the step time,
against the device-to-device copy bandwidth measured at the start. A last row
runs the real rollout path (`run_episodes`, tool loop, sampling) on the same
bf16 model with the tiny tokenizer's calculator prompts, plain loop vs engine.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from miniverl.engine.rollout.cuda_graph import StaticDecoder, run_episodes_fast
from miniverl.engine.core.device import environment
from miniverl.engine.models.loading import attach_lora, load_causal_lm
from miniverl.engine.core.recipe import LoraSpec
from miniverl.engine.rollout.loop import Budget, SamplingPolicy, select_next
from miniverl.engine.rollout.plain import run_episodes_plain
from miniverl.engine.tasks.calculator import CalculatorTask
from miniverl.engine.tiny.models import TOKENIZER_SIZE, load_tokenizer

GREEDY = SamplingPolicy(greedy=True)


def save_qwen3_0_6b(directory: Path, seed: int) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, max_position_embeddings=40960,
        rms_norm_eps=1e-6, use_sliding_window=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    del model
    torch.cuda.empty_cache()


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    src = torch.randn(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    times = []
    for _ in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times[3:])


def step_bytes(model, batch: int, context: float) -> float:
    """Bytes one decode step must read: every weight once (the embedding as the LM head) plus the live K/V.

    NF4 quantization constants (absmax, about 1/64 byte per weight) are not counted.
    """
    config = model.config
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if not any("lm_head" in n for n, _ in model.named_parameters()):  # tied: the head is the embedding
        emb = model.get_input_embeddings().weight
        weights += emb.numel() * emb.element_size()
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2 * batch * context
    return weights + kv


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


@torch.no_grad()
def plain_generate(model, prompts, new_tokens):
    ids = torch.tensor(prompts, device="cuda")
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.shape[1] == ids.shape[1] + new_tokens, "generate stopped early"
    return out[:, ids.shape[1]:].tolist()


@torch.no_grad()
def engine_generate(decoder: StaticDecoder, prompts, new_tokens):
    """The engine's per-step work without the tool loop: select_next, host sync, replay."""
    slots = list(range(len(prompts)))
    decoder.prefill(slots, prompts)
    out = [[] for _ in slots]
    for i in range(new_tokens):
        tokens, logprobs = select_next(decoder.logits, GREEDY, None)
        tokens, _ = tokens.tolist(), logprobs.tolist()
        for row, token in zip(out, tokens):
            row.append(token)
        if i + 1 < new_tokens:
            decoder.step(tokens, [len(prompts[0]) + i] * len(prompts))
    return out


def replay_ms(decoder: StaticDecoder, reps: int = 50) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        decoder.graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def kernels_per_step(decoder: StaticDecoder) -> int:
    """GPU operations (kernels, copies, fills) in one decode step, run eagerly under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        decoder._decode()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def graph_figures(decoder: StaticDecoder, batch: int, bytes_step: float, bandwidth: float, prefix: str = "") -> dict:
    """GPU operations per step (at batch 8) and the replayed graph's step time and bandwidth fraction."""
    row = {}
    if batch == 8:
        row[f"{prefix}gpu_ops_per_step"] = kernels_per_step(decoder)
    if decoder.graph is not None:
        row[f"{prefix}graph_step_ms"] = replay_ms(decoder)
        row[f"{prefix}graph_bw_fraction"] = bytes_step / (row[f"{prefix}graph_step_ms"] / 1e3) / bandwidth
    return row


def bench_batch(model, label, batch, args, bandwidth):
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, 151936, (batch, args.prompt_tokens), generator=gen).tolist()
    row = {"weights": label, "batch": batch, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens}
    generated = batch * args.new_tokens
    plain_out, t_plain = timed(lambda: plain_generate(model, prompts, args.new_tokens))
    decoder, t_setup = timed(lambda: StaticDecoder(model, batch, args.prompt_tokens + args.new_tokens, use_graph=True))
    engine_generate(decoder, prompts, 4)  # warm the prefill path
    engine_out, t_engine = timed(lambda: engine_generate(decoder, prompts, args.new_tokens))
    context = args.prompt_tokens + args.new_tokens / 2  # mean live context over the decode
    bytes_step = step_bytes(model, batch, context)
    row.update(
        plain_s=t_plain, plain_tok_s=generated / t_plain, plain_traj_s=batch / t_plain,
        engine_mode=decoder.mode, engine_fused_weights=decoder.fused_weights, engine_setup_s=t_setup, engine_s=t_engine,
        engine_tok_s=generated / t_engine, engine_traj_s=batch / t_engine, speedup=t_plain / t_engine,
        plain_step_ms=1e3 * t_plain / args.new_tokens, engine_step_ms=1e3 * t_engine / args.new_tokens,
        bytes_per_step=bytes_step,
        engine_bw_fraction=bytes_step / (t_engine / args.new_tokens) / bandwidth,
        plain_bw_fraction=bytes_step / (t_plain / args.new_tokens) / bandwidth,
        greedy_common_prefix_mean=statistics.mean(common_prefix(a, b) for a, b in zip(plain_out, engine_out)),
    )
    row.update(graph_figures(decoder, batch, bytes_step, bandwidth))
    del decoder
    if args.kernels:  # the Triton decode step (engine/rollout/fused_step.py), same prompts
        from miniverl.engine.rollout import decode_projection

        variants = [("kernels_", {}, None)]
        if args.no_pdl_too:
            variants.append(("kernels_no_pdl_", {}, False))
        if label == "nf4" and args.dense_copy:  # the decoder's dequantized copy (LoRA merged): kernels, modules
            variants.append(("kernels_dense_copy_", {"dense_copy": True}, None))
            variants.append(("module_dense_copy_", {"dense_copy": True, "kernels": False}, None))
        for prefix, options, pdl in variants:
            decode_projection.PDL = pdl
            try:
                fused = StaticDecoder(model, batch, args.prompt_tokens + args.new_tokens, use_graph=True,
                                      **{"kernels": True, **options})
                engine_generate(fused, prompts, 4)
                fused_out, t_fused = timed(lambda: engine_generate(fused, prompts, args.new_tokens))
                row.update({f"{prefix}mode": fused.mode, f"{prefix}step_ms": 1e3 * t_fused / args.new_tokens,
                            f"{prefix}greedy_common_prefix_mean": statistics.mean(
                                common_prefix(a, b) for a, b in zip(engine_out, fused_out))})
                row.update(graph_figures(fused, batch, bytes_step, bandwidth, prefix=prefix))
                del fused
            except Exception as exc:  # noqa: BLE001 - keep the other variants
                row[f"{prefix}error"] = f"{type(exc).__name__}: {exc}"
            finally:
                decode_projection.PDL = None
    torch.cuda.empty_cache()
    return row


def bench_rollout(model, args):
    """The real rollout path: calculator prompts, tool loop, temperature-1 sampling."""
    tokenizer = load_tokenizer()
    calculator = CalculatorTask()
    tasks = calculator.items("train", args.rollout_tasks, 0)
    budget = Budget(max_turns=3, max_new_tokens_per_turn=64, max_total_tokens=320)
    policy = SamplingPolicy(greedy=False, temperature=1.0, top_p=1.0)
    row = {"weights": "bf16", "batch": 32, "tasks": len(tasks), "budget": [3, 64, 320]}
    for name, fn in (("plain", run_episodes_plain), ("engine", run_episodes_fast)):
        gen = torch.Generator("cuda").manual_seed(0)
        episodes, t = timed(lambda: fn(model, tokenizer, calculator, tasks, policy, budget, gen, TOKENIZER_SIZE, "cuda", 32))
        tokens = sum(len(e.sampling_logprobs) for e in episodes)
        row.update({f"{name}_s": t, f"{name}_tok_s": tokens / t, f"{name}_traj_s": len(episodes) / t,
                    f"{name}_generated_tokens": tokens})
    row["speedup"] = row["plain_s"] / row["engine_s"]
    return row


def markdown(result) -> str:
    lines = [
        "# Rollout decode throughput on one H200", "",
        f"Command: `{result['command']}`", "",
        f"Qwen3-0.6B shape, random weights, LoRA r=8 on all projections; {result['rows'][0]['prompt_tokens']} prompt "
        f"+ {result['rows'][0]['new_tokens']} new tokens, greedy, no EOS stop. Copy bandwidth measured: "
        f"{result['copy_bandwidth_TBps']:.2f} TB/s. Bandwidth fraction = (weights + live K/V bytes per step) / step time / copy bandwidth.",
        "",
        "| weights | batch | generate tok/s | engine tok/s | speedup | engine traj/s | graph step ms | BW fraction (end to end) | BW fraction (graph step) | mode |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['weights']} | {r['batch']} | error: {r['error']} |")
            continue
        lines.append(
            f"| {r['weights']} | {r['batch']} | {r['plain_tok_s']:.1f} | {r['engine_tok_s']:.0f} | {r['speedup']:.1f}x | "
            f"{r['engine_traj_s']:.2f} | {r.get('graph_step_ms', float('nan')):.2f} | {r['engine_bw_fraction']:.1%} | "
            f"{r.get('graph_bw_fraction', float('nan')):.1%} | {r['engine_mode']} |"
        )
    ops = [f"{r['weights']} {r['gpu_ops_per_step']}" for r in result["rows"] if "gpu_ops_per_step" in r]
    if ops:
        lines += ["", f"GPU operations per decode step at batch 8 (profiled eagerly): {', '.join(ops)}."]
    ro = result.get("rollout")
    if ro and "error" not in ro:
        lines += ["", f"Rollout path (`run_episodes`, tool loop, temperature-1 sampling, {ro['tasks']} calculator tasks, "
                      f"batch 32, bf16): plain loop {ro['plain_tok_s']:.0f} tok/s / {ro['plain_traj_s']:.2f} traj/s, "
                      f"engine {ro['engine_tok_s']:.0f} tok/s / {ro['engine_traj_s']:.2f} traj/s ({ro['speedup']:.1f}x)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--weights", nargs="+", default=["bf16", "nf4"])
    parser.add_argument("--rollout-tasks", type=int, default=64)
    parser.add_argument("--kernels", action="store_true",
                        help="also time the decode step through the Triton kernels (StaticDecoder(kernels=True))")
    parser.add_argument("--no-pdl-too", action="store_true",
                        help="with --kernels: also without programmatic dependent launch")
    parser.add_argument("--dense-copy", action="store_true",
                        help="with --kernels: also the NF4 model through the kernels over its dense copy")
    parser.add_argument("--lora-rank", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("rollout_bench needs a CUDA device")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "machine": {"host": platform.node(), **environment()},
        "copy_bandwidth_TBps": copy_bandwidth() / 1e12,
        "rows": [],
    }
    bandwidth = result["copy_bandwidth_TBps"] * 1e12

    def write():
        (args.out_dir / "rollout_h200.json").write_text(json.dumps(result, indent=2))
        (args.out_dir / "rollout_h200.md").write_text(markdown(result))

    with tempfile.TemporaryDirectory() as tmp:
        save_qwen3_0_6b(Path(tmp), seed=0)
        for label in args.weights:
            model = attach_lora(load_causal_lm(Path(tmp), torch.bfloat16, "cuda", nf4=label == "nf4"), LoraSpec(r=args.lora_rank, alpha=2.0 * args.lora_rank),
                               seed=0)
            plain_generate(model, [[1] * 8], 4)  # warm up generate
            for batch in args.batches:
                try:
                    row = bench_batch(model, label, batch, args, bandwidth)
                except Exception as exc:  # noqa: BLE001 - keep the other rows
                    row = {"weights": label, "batch": batch, "error": f"{type(exc).__name__}: {exc}"}
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
                write()
            if label == "bf16" and args.rollout_tasks:
                try:
                    result["rollout"] = bench_rollout(model, args)
                except Exception as exc:  # noqa: BLE001
                    result["rollout"] = {"error": f"{type(exc).__name__}: {exc}"}
                print(json.dumps(result["rollout"]), flush=True)
                write()
            del model
            torch.cuda.empty_cache()
    print(markdown(result))


if __name__ == "__main__":
    main()
