"""The dry run's report: typed sections, their JSON (msgspec's encoding) and their terminal rendering."""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

from miniverl.engine.core.artifacts import Resolution

NOTE = ("an estimate from configs and budgets, not a measurement: allocator fragmentation, kernels and "
        "library versions differ, so only a real run proves the fit")


# ---------------------------------------------------------------- the report
# A field left UNSET is absent from the JSON (a None is `null`), so each
# section carries exactly the keys it could fill.
class Shape(msgspec.Struct, kw_only=True):
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


class ModelReport(msgspec.Struct, kw_only=True):
    role: str
    id: str
    revision: str | None
    dir: str
    config_readable: bool
    config_sha256: str | UnsetType = UNSET
    architecture: str | UnsetType = UNSET
    model_type: str | None | UnsetType = UNSET
    shape: Shape | None | UnsetType = UNSET
    parameters_from_config: int | None | UnsetType = UNSET
    parameters_in_checkpoint: int | None | UnsetType = UNSET


class TokenizerReport(msgspec.Struct, kw_only=True):
    compatible: bool
    student_sha256: str | UnsetType = UNSET
    teacher_sha256: str | UnsetType = UNSET
    byte_identical: bool | UnsetType = UNSET
    tokenizer_size: int | UnsetType = UNSET
    student_vocab_rows: int | UnsetType = UNSET
    teacher_vocab_rows: int | UnsetType = UNSET
    padded_rows: str | UnsetType = UNSET
    padded_row_count: int | UnsetType = UNSET
    reason: str


class StudentAdapterReport(msgspec.Struct, kw_only=True):
    kind: str = "lora"
    r: int
    alpha: float
    target_modules: list[str]
    trainable_parameters: int | None
    base_id: str
    base_revision: str | None
    base_config_sha256: str
    origin: str


class TeacherAdapterReport(msgspec.Struct, kw_only=True):
    kind: str  # "none" or "frozen adapter"
    path: str | UnsetType = UNSET
    base_id: str | UnsetType = UNSET
    base_revision: str | None | UnsetType = UNSET
    sha256: str | UnsetType = UNSET  # only once the adapter passed every check
    adapter_config_base: str | None | UnsetType = UNSET


class Adapters(msgspec.Struct, kw_only=True):
    student: StudentAdapterReport
    teacher: TeacherAdapterReport


class StageMemory(msgspec.Struct, kw_only=True):
    stage: str
    weights: int
    adapter: int
    kv_cache: int
    activations: int
    chunk_tensors: int
    runtime: int
    total: int


class MemoryReport(msgspec.Struct, kw_only=True):
    device: str
    dtype: str
    free_bytes: int | None
    free_source: str
    stages: list[StageMemory]
    fits_by_estimate: bool | None


class DryRunReport(msgspec.Struct, kw_only=True):
    recipe: str
    resolved: dict[str, Resolution]
    models: list[ModelReport] | UnsetType = UNSET
    tokenizer: TokenizerReport | UnsetType = UNSET
    adapters: Adapters | UnsetType = UNSET
    memory_note: str | UnsetType = UNSET
    memory: MemoryReport | UnsetType = UNSET
    problems: list[str]
    note: str = NOTE


def to_json(report: DryRunReport) -> str:
    return msgspec.json.encode(report).decode()


# ---------------------------------------------------------------- rendering
def _mib(n: int | None) -> str:
    if n is None:
        return "unknown"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _memory_table(mem: MemoryReport):
    """One unit for the whole table (GiB once any stage reaches 1 GiB), so it fits 80 columns."""
    from rich import box
    from rich.table import Table

    gib = max(s.total for s in mem.stages) >= 2**30
    unit, scale = ("GiB", 2**30) if gib else ("MiB", 2**20)
    table = Table(title=f"memory estimate in {unit} on {mem.device} in {mem.dtype}", title_justify="left",
                  box=box.SIMPLE_HEAD)
    columns = (("weights", "weights"), ("adapter", "adapter"), ("kv_cache", "KV"), ("activations", "activ."),
               ("chunk_tensors", "chunk"), ("runtime", "runtime"), ("total", "total"))
    table.add_column("stage", no_wrap=True)
    for _, header in columns:
        table.add_column(header, justify="right", no_wrap=True)
    for stage in mem.stages:
        table.add_row(stage.stage, *(f"{getattr(stage, key) / scale:.1f}" for key, _ in columns))
    return table


def _count(n: int | None) -> str:
    return "?" if n is None else f"{n:,}"


def _model_line(m: ModelReport) -> str:
    counted, from_config = m.parameters_in_checkpoint, m.parameters_from_config
    if from_config is None or m.shape is None:
        sizes = f"{_count(counted)} parameters in the checkpoint (sizes not read from this config)"
    else:
        check = "" if counted is None else (
            " = checkpoint" if counted == from_config else f"; checkpoint holds {counted:,}")
        sizes = f"{m.shape.layers} layers x {m.shape.hidden}, {from_config:,} parameters from config{check}"
    return (f"  {m.role:<8} {m.id} @ {m.revision or 'unpinned'}: {m.architecture}, config readable "
            f"(sha256 {m.config_sha256[:12]}), {sizes}")


def render(console, report: DryRunReport) -> None:
    def say(text: str) -> None:
        console.print(text, highlight=False, markup=False)

    say(f"dry run of {report.recipe}: no weights are loaded and nothing is trained")
    width = max((len(key) for key in report.resolved), default=16)
    for key, r in report.resolved.items():
        say(f"  {key:<{width}} {r.value:<17} ({r.reason})")
    if report.models is UNSET:
        return
    say("models")
    for m in report.models:
        if not m.config_readable:
            say(f"  {m.role:<8} {m.id}: config.json unreadable")
            continue
        say(_model_line(m))
        say(f"           {m.dir}")
    t = report.tokenizer
    if t is not UNSET and t.tokenizer_size is not UNSET:
        same = "byte-identical tokenizer files" if t.byte_identical else "tokenizer files DIFFER"
        say(f"tokenizer  {same} (sha256 {t.student_sha256[:12]}), {t.tokenizer_size} tokens; output rows: "
            f"student {t.student_vocab_rows}, teacher {t.teacher_vocab_rows}")
        if t.padded_row_count:
            say(f"           padded rows {t.padded_rows} ({t.padded_row_count}) lie beyond the tokenizer: "
                "masked out of every loss and never sampled")
    if report.adapters is not UNSET:
        s, te = report.adapters.student, report.adapters.teacher
        say(f"adapter    student: LoRA r={s.r} alpha={s.alpha} on {','.join(s.target_modules)}, "
            f"{_count(s.trainable_parameters)} trainable parameters over base {s.base_id} @ "
            f"{s.base_revision or 'unpinned'} ({s.origin})")
        say(f"           teacher: {te.kind}" + (f" {te.path} on {te.base_id}" if te.kind != "none" else ""))
    if report.memory_note is not UNSET:
        say(report.memory_note)
    if report.memory is not UNSET:
        _render_memory(console, say, report.memory)
    say(f"note: {report.note}")


def _render_memory(console, say, mem: MemoryReport) -> None:
    console.print(_memory_table(mem))
    say(f"free here: {_mib(mem.free_bytes)} ({mem.free_source})")
    largest = max(mem.stages, key=lambda s: s.total)
    if mem.fits_by_estimate is None:
        say(f"largest stage {largest.stage} needs ~{_mib(largest.total)}; free memory is unknown here")
    else:
        verdict = "fits" if mem.fits_by_estimate else "does NOT fit"
        say(f"largest stage {largest.stage} needs ~{_mib(largest.total)} of {_mib(mem.free_bytes)} free: "
            f"{verdict} by this estimate")
