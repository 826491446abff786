"""`miniverl inspect`: what a run or one of its artifacts holds, for humans."""

from __future__ import annotations

from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from miniverl.engine.core.artifacts import (
    PROVENANCE_MODEL, PROVENANCE_PROMPT, PROVENANCE_TOOL, Checkpoint, Envelope, Gradient, Preflight, Rollout, TeacherScore,
    VerifyReport, decode_artifact, read_tensors,
)
from miniverl.engine.core import layout
from miniverl.engine.core.errors import ArtifactError, ArtifactPruned, MiniverlError
from miniverl.engine.core.rundir import RunDir, pruned_message

KINDS = {k.__name__: k for k in (Preflight, Checkpoint, Rollout, TeacherScore, Gradient, VerifyReport)}
SPAN_STYLE = {PROVENANCE_PROMPT: "dim", PROVENANCE_MODEL: "bold green", PROVENANCE_TOOL: "cyan"}


def load_any(path: Path):
    data = path.read_bytes()
    try:
        kind = msgspec.msgpack.decode(data, type=Envelope).kind
    except msgspec.DecodeError:
        raise ArtifactError(f"{path}: not a miniverl artifact") from None
    if kind not in KINDS:
        raise ArtifactError(f"{path}: unknown artifact kind {kind}")
    return decode_artifact(data, KINDS[kind], str(path))


def run_root_of(path: Path) -> Path | None:
    """The run directory an artifact file lies in (the nearest parent with a journal), if any."""
    for parent in path.resolve().parents:
        if (parent / layout.JOURNAL_FILE).is_file():
            return parent
    return None


def student_tokenizer(recipe):
    """The student's tokenizer for decoding spans; None when it cannot be loaded here."""
    from miniverl.engine.models.loading import load_tokenizer, locate_model

    try:
        s = recipe.models.student
        return load_tokenizer(locate_model("student", s.id, s.revision, s.path))
    except (MiniverlError, ImportError, OSError):
        return None


def show_file(console: Console, path: Path, limit: int) -> None:
    """An artifact given by its path; spans are decoded when the file lies inside a run."""
    from miniverl.engine.core.recipe import parse_recipe

    artifact = load_any(path)
    root = run_root_of(path)
    tokenizer = None
    if root is not None and (root / layout.RECIPE_FILE).is_file():
        tokenizer = student_tokenizer(parse_recipe((root / layout.RECIPE_FILE).read_text(encoding="utf-8")))
    show(console, artifact, root, tokenizer, limit)


def journal_table(run: RunDir) -> Table:
    table = Table(title=f"run {run.root.name}")
    for column in ("stage", "state", "seconds", "peak MiB", "attempts"):
        table.add_column(column)
    for key, rec in run.read_journal().stages.items():
        peak = f"{rec.peak_memory_bytes / 2**20:.0f}" if rec.peak_memory_bytes else "-"
        state = f"{rec.state} (files pruned)" if rec.pruned else rec.state
        table.add_row(key, state, f"{rec.seconds:.2f}" if rec.seconds else "-", peak, str(rec.attempts))
    return table


def spans_text(tokenizer, token_ids: list[int], provenance: list[int]) -> Text:
    """The trajectory with prompt dim, model tokens green, tool responses cyan."""
    text = Text()
    start = 0
    for i in range(1, len(token_ids) + 1):
        if i == len(token_ids) or provenance[i] != provenance[start]:
            piece = tokenizer.decode(token_ids[start:i], skip_special_tokens=False) if tokenizer else str(token_ids[start:i])
            text.append(piece, style=SPAN_STYLE.get(provenance[start], ""))
            start = i
    return text


def show(console: Console, artifact, run_root: Path | None, tokenizer, limit: int = 3) -> None:
    if isinstance(artifact, Rollout):
        n = len(artifact.trajectories)
        console.print(f"rollout of cycle {artifact.cycle}: {n} trajectories, {artifact.generated_tokens} generated tokens, "
                      f"tool-call {sum(t.tool_called for t in artifact.trajectories) / n:.0%}, "
                      f"strict success {sum(t.strict_success for t in artifact.trajectories) / n:.0%}")
        console.print("spans: [dim]prompt[/] [bold green]model[/] [cyan]tool response[/]")
        for traj in artifact.trajectories[:limit]:
            console.rule(f"{traj.task_id}  finish={traj.finish_reason}  success={traj.strict_success}")
            console.print(spans_text(tokenizer, traj.token_ids, traj.provenance))
    elif isinstance(artifact, Gradient):
        console.print(msgspec.to_builtins(msgspec.structs.replace(artifact)))
    elif isinstance(artifact, TeacherScore):
        console.print(f"teacher scores of cycle {artifact.cycle}, mode {artifact.mode}, "
                      f"{sum(artifact.positions)} model positions over {len(artifact.positions)} trajectories")
        if run_root is not None:
            for name, tensor in read_tensors(run_root, artifact.tensors).items():
                console.print(f"  {name}: {tuple(tensor.shape)} {tensor.dtype}")
    elif isinstance(artifact, VerifyReport):
        console.print(f"verify ({artifact.label}) on {artifact.tasks} held-out tasks: tool-call {artifact.tool_call_rate:.1%}, "
                      f"format {artifact.format_validity:.1%}, strict success {artifact.strict_success:.1%}")
        for item in artifact.items[:limit]:
            console.print(f"  {item.task_id} {item.question!r} -> {item.turns!r} success={item.strict_success}")
    else:
        console.print(msgspec.to_builtins(artifact))


def artifact_path(run: RunDir, stage: str, cycle: int | None, label: str | None = None) -> Path:
    ref = layout.shown_artifact(stage, cycle, label)
    if run.read_journal().is_pruned(ref):
        raise ArtifactPruned(pruned_message(ref.path))
    return run.root / ref.path
