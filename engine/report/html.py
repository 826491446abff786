"""`miniverl report RUN`: one self-contained HTML page about a run.

Inline SVG charts (engine.svg_charts), inline CSS, no JavaScript and no
network: the page can be mailed or archived as one file. It shows loss and KL
per cycle, the rollout tool-call rate per cycle, the verifier's tool-call rate
and strict success before and after training, seconds and peak memory per
stage, and a few decoded trajectories with their spans coloured by provenance.
"""

from __future__ import annotations

import time
from html import escape
from pathlib import Path

from miniverl.engine.core import layout
from miniverl.engine.core.artifacts import PROVENANCE_MODEL, PROVENANCE_PROMPT, PROVENANCE_TOOL
from miniverl.engine.report.summary import RunSummary, stage_totals
from miniverl.engine.report.svg_charts import bar_chart, hbar_chart, line_chart

SPAN_CLASS = {PROVENANCE_PROMPT: "prompt", PROVENANCE_MODEL: "model", PROVENANCE_TOOL: "tool"}

CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1000px; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
.chart { border: 1px solid #ddd; background: #fff; }
.chart-title { font-size: 13px; font-weight: 600; }
.axis { stroke: #444; } .grid { stroke: #eee; }
.tick, .axis-label { font-size: 10px; fill: #444; }
table { border-collapse: collapse; font-size: 0.9em; }
td, th { border-bottom: 1px solid #eee; padding: 3px 10px; text-align: right; }
td:first-child, th:first-child { text-align: left; }
.traj { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 12px; border: 1px solid #ddd;
        padding: 8px; background: #fafafa; }
.prompt { color: #888; } .model { color: #116611; font-weight: 600; } .tool { color: #0b6f8a; background: #e6f6fa; }
.pass { color: #116611; font-weight: 600; } .fail { color: #b00; font-weight: 600; } .note { color: #666; font-size: 0.9em; }
"""


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _mib(n: int | None) -> str:
    return "-" if not n else f"{n / 2**20:.0f}"


def _header(summary: RunSummary) -> str:
    row, manifest = summary.row, summary.manifest
    lines = [f"<h1>miniverl run {escape(row.run_id)}</h1>",
             f"<p>recipe <b>{escape(summary.recipe.name)}</b>, status <b>{escape(row.status)}</b>, "
             f"{row.cycles_done}/{summary.recipe.train.cycles} cycles, "
             f"last stage done {escape(row.last_stage_done or '-')}.</p>"]
    if manifest is not None:
        gate, env, resolved = manifest.quality_gate, manifest.environment, manifest.resolved
        verdict = '<span class="pass">passed</span>' if gate.passed else '<span class="fail">FAILED</span>'
        lines.append(f"<p>Quality gate {verdict} ({escape(gate.reason)}); strict held-out success "
                     f"{_percent(manifest.verify_baseline.strict_success)} &rarr; "
                     f"{_percent(manifest.verify.strict_success)}, final tool-call rate "
                     f"{_percent(manifest.verify.tool_call_rate)}; OOM retries {manifest.oom_retries}.</p>")
        device, dtype = (resolved[k].value if k in resolved else "?" for k in ("device", "dtype"))
        lines.append(f"<p class=\"note\">{escape(env.get('gpu', 'CPU'))}, torch {escape(env.get('torch', '?'))}, "
                     f"device {escape(device)}, dtype {escape(dtype)}</p>")
    else:
        lines.append('<p class="note">No manifest yet: the run has not finished; figures below are what it has.</p>')
    return "".join(lines)


def _charts(summary: RunSummary) -> str:
    cycles = summary.cycles
    charts = [
        line_chart("Loss per cycle", {"loss": [(c.cycle, c.loss) for c in cycles if c.loss is not None]},
                   "cycle", "loss"),
        line_chart("KL per cycle", {"kl": [(c.cycle, c.kl) for c in cycles if c.kl is not None]}, "cycle", "KL"),
        line_chart("Rollout per cycle", {
            "rollout tool-call rate": [(c.cycle, c.tool_call_rate) for c in cycles if c.tool_call_rate is not None],
            "rollout strict success": [(c.cycle, c.rollout_success) for c in cycles if c.rollout_success is not None],
        }, "cycle", "rate", percent=True),
    ]
    labels = [label for label in layout.VERIFY_LABELS if label in summary.verify]
    if labels:
        groups = ["tool-call rate", "strict success", "format validity"]
        charts.append(bar_chart("Held-out verifier", groups, {
            label: [summary.verify[label].tool_call_rate, summary.verify[label].strict_success,
                    summary.verify[label].format_validity] for label in labels}, "rate"))
    totals = stage_totals(summary.stages)
    if totals:
        charts.append(hbar_chart("Seconds per stage (all cycles)",
                                 [(name, float(t["seconds"])) for name, t in totals.items()], "s",
                                 lambda v: f"{v:.1f} s"))
        what = "CUDA max allocated" if summary.device == "cuda" else "process max RSS so far"
        charts.append(hbar_chart(f"Peak memory per stage ({what})",
                                 [(name, float(t["peak_memory_bytes"]) / 2**20) for name, t in totals.items()], "MiB",
                                 lambda v: f"{v:.0f} MiB"))
    return '<h2>Charts</h2><div class="charts">' + "".join(charts) + "</div>"


def _stage_table(summary: RunSummary) -> str:
    rows = "".join(
        f"<tr><td>{escape(s.stage)}</td><td>{escape(s.state)}</td>"
        f"<td>{'-' if s.seconds is None else f'{s.seconds:.2f}'}</td><td>{_mib(s.peak_memory_bytes)}</td>"
        f"<td>{s.attempts}</td></tr>" for s in summary.stages)
    cycle_rows = "".join(
        f"<tr><td>{c.cycle + 1}</td><td>{'-' if c.loss is None else f'{c.loss:+.4f}'}</td>"
        f"<td>{'-' if c.kl is None else f'{c.kl:.4f}'}</td><td>{_percent(c.tool_call_rate)}</td>"
        f"<td>{_percent(c.rollout_success)}</td><td>{c.generated_tokens or '-'}</td>"
        f"<td>{'-' if c.tokens_per_second is None else f'{c.tokens_per_second:.1f}'}</td>"
        f"<td>{c.chunk_size or '-'}</td><td>{c.oom_retries}</td></tr>" for c in summary.cycles)
    return ("<h2>Cycles</h2><table><tr><th>cycle</th><th>loss</th><th>KL</th><th>tool-call</th><th>success</th>"
            "<th>generated tokens</th><th>tokens/s</th><th>chunk</th><th>OOM retries</th></tr>" + cycle_rows +
            "</table><h2>Stages</h2><table><tr><th>stage</th><th>state</th><th>seconds</th><th>peak MiB</th>"
            "<th>attempts</th></tr>" + rows + "</table>")


def spans_html(tokenizer, token_ids: list[int], provenance: list[int]) -> str:
    """The trajectory with each run of same-provenance tokens in one coloured <span>."""
    parts, start = [], 0
    for i in range(1, len(token_ids) + 1):
        if i == len(token_ids) or provenance[i] != provenance[start]:
            piece = (tokenizer.decode(token_ids[start:i], skip_special_tokens=False) if tokenizer is not None
                     else " ".join(map(str, token_ids[start:i])) + " ")
            parts.append(f'<span class="{SPAN_CLASS.get(provenance[start], "")}">{escape(piece)}</span>')
            start = i
    return "".join(parts)


def _trajectories(summary: RunSummary, tokenizer, per_cycle: int) -> str:
    picked = summary.trajectories(per_cycle)
    if not picked:
        return ""
    note = "" if tokenizer is not None else '<p class="note">tokenizer unavailable: token ids shown</p>'
    blocks = [f"<h3>cycle {cycle + 1}, {escape(t.task_id)}: {escape(t.question)} (finish {escape(t.finish_reason)}, "
              f"tool called {t.tool_called}, strict success {t.strict_success})</h3>"
              f'<div class="traj">{spans_html(tokenizer, t.token_ids, t.provenance)}</div>' for cycle, t in picked]
    legend = ('<p>Spans: <span class="prompt">prompt</span> · <span class="model">model</span> · '
              '<span class="tool">tool response</span></p>')
    return "<h2>Trajectories</h2>" + legend + note + "".join(blocks)


def render(summary: RunSummary, tokenizer, per_cycle: int = 2) -> str:
    missing = "".join(f"<li>{escape(m)}</li>" for m in summary.missing)
    body = (_header(summary) + _charts(summary) + _stage_table(summary) + _trajectories(summary, tokenizer, per_cycle)
            + (f'<h2>Unreadable artifacts</h2><ul class="note">{missing}</ul>' if missing else "")
            + f'<p class="note">written {time.strftime("%Y-%m-%d %H:%M:%S")} by miniverl report</p>')
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>miniverl run '
            f'{escape(summary.row.run_id)}</title><style>{CSS}</style></head><body>{body}</body></html>\n')


def write_tensorboard(summary: RunSummary, directory: Path) -> str:
    """The run's TensorBoard scalars, the points the run wrote live included once (the sink reads them back)."""
    from miniverl.engine.run.metrics import TensorBoardSink, cycle_metrics, missing_package, scalars, verify_scalars

    missing = missing_package(summary.recipe)
    if missing is not None:
        return missing
    journal = summary.run.read_journal()
    sink = TensorBoardSink(directory)
    try:
        for c in summary.cycles:
            m = cycle_metrics(journal.stages, c.cycle)
            if m is not None:
                sink.write(scalars(m), c.cycle + 1)
        for label, report in summary.verify.items():
            sink.write(verify_scalars(report), layout.verified_step(label, summary.recipe.train.cycles))
    finally:
        sink.close()
    return f"TensorBoard scalars in {directory}"


def write_report(run_id: str, runs_dir: Path, out: Path | None, per_cycle: int) -> tuple[Path, list[str]]:
    """Write the page (default: runs/<id>/report.html); return its path and what else happened."""
    from miniverl.engine.core.errors import MiniverlError
    from miniverl.engine.models.loading import load_tokenizer, locate_model
    from miniverl.engine.report.summary import summarize
    from miniverl.engine.run.commands import open_run, quiet_libraries

    run, recipe = open_run(run_id, runs_dir)
    quiet_libraries()
    summary = summarize(run, recipe)
    try:
        s = recipe.models.student
        tokenizer = load_tokenizer(locate_model("student", s.id, s.revision, s.path))
    except (MiniverlError, ImportError, OSError):
        tokenizer = None
    path = out or run.root / "report.html"
    from miniverl.engine.core.atomic_io import write_bytes_atomic

    write_bytes_atomic(path, render(summary, tokenizer, per_cycle).encode("utf-8"))
    notes = [write_tensorboard(summary, run.root / "tensorboard")] if recipe.report.tensorboard else []
    return path, notes
