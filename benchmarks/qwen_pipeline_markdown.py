"""The Markdown report of `qwen_pipeline.py`'s JSON result (kept apart: the measuring script is long enough)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen_assets import TOKENIZER_SIZE  # noqa: E402

GIB = 2**30


def markdown(result: dict) -> str:
    lines = ["# Qwen3 recipes at the real shapes (random weights), one GPU", ""]
    env = result["environment"]
    lines += [f"GPU {env.get('gpu')} ({env.get('gpu_memory_gib')} GiB, compute capability "
              f"{env.get('compute_capability')}), driver {env.get('driver')}; torch {env.get('torch')} "
              f"(CUDA {env.get('cuda_build')}), transformers {env.get('transformers')}, peft {env.get('peft')}, "
              f"bitsandbytes {env.get('bitsandbytes')}.", "", "Commands (from the repository root, on the GPU machine):", "",
              "```", *result["commands"], "```", "",
              "Every token budget, batch size, chunk size and strategy is the shipped recipe's; the overrides "
              "(models.*.path aside) are listed per recipe.", ""]
    for key, title in (("calc", "qwen_consumer_gpu_calc.yaml (dual_model)"),
                       ("shared", "qwen_consumer_gpu_shared.yaml (shared_backbone)")):
        run = result.get(key)
        if not run:
            continue
        m = result.get(f"measure_{key}", {})
        held = m.get("weights_bytes", {}).get("total") if isinstance(m, dict) else None
        lines += [f"## {title}", "", f"Overrides: `{json.dumps(result.get('overrides', {}).get(key, {}))}`.", ""]
        if held:
            w = m["weights_bytes"]
            lines.append(f"Weights on the GPU: student {w['student'] / GIB:.3f} GiB (incl. LoRA), "
                         f"teacher {w['teacher'] / GIB:.3f} GiB, together {held / GIB:.3f} GiB; "
                         f"both stay resident ({run.get('resolved', {}).get('memory.strategy', {}).get('reason', '')}).")
            lines.append("")
        lines += ["| stage | seconds | peak allocated GiB | peak reserved GiB | above the weights GiB | OOM retries |",
                  "| --- | ---: | ---: | ---: | ---: | --- |"]
        for row in run.get("stages", []):
            above = f"{row['peak_allocated_gib'] - held / GIB:+.3f}" if held else "n/a"
            lines.append(f"| {row['stage']} | {row['seconds']:.1f} | {row['peak_allocated_gib']:.3f} | "
                         f"{row['peak_reserved_gib']:.3f} | {above} | {row['oom_retries'] or ''} |")
        if run.get("stages"):
            top = max(run["stages"], key=lambda r: r["peak_allocated_gib"])
            top_r = max(run["stages"], key=lambda r: r["peak_reserved_gib"])
            lines += ["", f"Peak over all stages: {top['peak_allocated_gib']:.3f} GiB allocated ({top['stage']}), "
                          f"{top_r['peak_reserved_gib']:.3f} GiB reserved ({top_r['stage']})."]
        lines += ["", f"Trainable parameters: {run.get('trainable_parameters')}; chunk sizes used: "
                      f"{run.get('chunk_sizes_used')}; completed: {run.get('completed')}."]
        if "trajectory_tokens" in run:
            t = run["trajectory_tokens"]
            lines.append(f"Cycle 0 trajectories: {t.get('total')} tokens, prompts {t.get('prompt')}, "
                         f"finish {sorted(set(t.get('finish', [])))}.")
        if "resume" in run:
            r = run["resume"]
            lines.append(f"Kill at `{r['killed_at']}`: first process exit {r['kill_rc']} (SIGKILL), "
                         f"`resume` exit {r['resume_rc']}; that stage ran {r['killed_stage_attempts']} times.")
        if m.get("error"):
            lines += ["", f"Gradient-stage measurement failed: {m['error'][-500:]}"]
        elif m:
            lines += ["", f"Gradient stage alone ({m['trajectories']} trajectories x {m['tokens_per_trajectory']} "
                          f"tokens = {m['positions']} trained positions, vocabulary {TOKENIZER_SIZE}):", "",
                      "| implementation | peak above its start GiB | seconds |", "| --- | ---: | ---: |",
                      f"| chunked (the stage, chunk {m['chunk_size']}, micro-batch {m['trajectory_batch_size']}) | "
                      f"{m['chunked']['peak_extra_bytes'] / GIB:.3f} | {m['chunked']['seconds']:.2f} |",
                      f"| naive full [T, V] float32 logits | {m['naive']['peak_extra_bytes'] / GIB:.3f} | "
                      f"{m['naive']['seconds']:.2f} |", "",
                      f"Naive / chunked peak: {m['naive_over_chunked_peak']:.1f}x; relative gradient difference "
                      f"{m['gradient_rel_diff']:.2e} (bf16 logits vs float32 upcast). Allocated before the stage "
                      f"besides the weights (cuBLAS workspace and the like): "
                      f"{m.get('cublas_and_other_before_bytes', 0) / GIB:.3f} GiB.", "",
                      "| loss.chunk_size | gradient stage peak above its start GiB | seconds |", "| ---: | ---: | ---: |"]
            lines += [f"| {chunk} | {v['peak_extra_bytes'] / GIB:.3f} | {v['seconds']:.2f} |"
                      for chunk, v in sorted(m.get("chunked_by_chunk_size", {}).items(), key=lambda kv: int(kv[0]))]
        lines.append("")
    if result.get("notes"):
        lines += ["## Notes", ""] + [f"- {note}" for note in result["notes"]] + [""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
