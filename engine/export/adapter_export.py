"""`miniverl export-adapter`: a run's checkpoint as a standard PEFT directory, optionally with a merged model.

Everything a user can get wrong is refused before anything is written; the
directory is then filled under a temporary name and renamed into place, so it
appears whole or not at all (kill points `export:*`).
"""

from __future__ import annotations

import errno
import json
from dataclasses import dataclass
from pathlib import Path

import msgspec

from miniverl.engine.core import layout
from miniverl.engine.core.atomic_io import DiskWriteError, directory_atomically, sha256_file
from miniverl.engine.core.errors import IncompatibleModelsError, UserError
from miniverl.engine.core.faults import kill_point
from miniverl.engine.core.recipe import LoraSpec
from miniverl.engine.export.card import model_card
from miniverl.engine.export.peft_dir import (
    copy_tokenizer, readable_by_all, save_adapter, save_merged, student_on_cpu,
)
from miniverl.engine.export.run_checkpoint import RunCheckpoint, read_checkpoint
from miniverl.engine.models.loading import ADAPTER_WEIGHTS, locate_model, tokenizer_sha256
from miniverl.engine.run.commands import open_run, quiet_libraries

MERGED_DIR = "merged"
PROVENANCE_FILE = "miniverl_provenance.json"
# Errors that mean "this place cannot hold the directory", not "the disk failed while writing".
_PLACE_ERRORS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.ENOENT, errno.EEXIST, errno.EISDIR}


@dataclass(frozen=True)
class Exported:
    directory: Path
    step: int
    finished: bool
    adapter_sha256: str
    merged: Path | None


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise UserError(f"--out {out} already exists; pass --force to replace it, or choose another directory")
    for folder in (out.parent, *out.parent.parents):
        if folder.exists():
            if not folder.is_dir():
                raise UserError(f"cannot write --out {out}: {folder} is a file, not a directory")
            break


def _check_base(source: RunCheckpoint, student_dir: Path) -> None:
    """The base on disk must still be the one the run trained against."""
    recorded = source.model("student")
    now = sha256_file(student_dir / "config.json")
    if now != recorded.config_sha256:
        raise IncompatibleModelsError(
            f"the student base {student_dir} changed since run {source.run.root.name} trained on it (config.json "
            f"sha256 {now[:12]}, recorded {recorded.config_sha256[:12]}); restore the base the run used")
    if tokenizer_sha256(student_dir) != source.preflight.tokenizer.student_sha256:
        raise IncompatibleModelsError(
            f"the tokenizer of {student_dir} changed since run {source.run.root.name} trained with it; "
            f"restore the base the run used")


def _provenance(source: RunCheckpoint, adapter_sha256: str, merged_dtype: str | None) -> bytes:
    student = source.model("student")
    manifest = source.manifest
    document = {
        "run_id": source.run.root.name, "recipe": source.recipe.name, "step": source.step,
        "cycles": source.recipe.train.cycles, "run_finished": source.finished, "final_step": source.is_final,
        "base_id": student.id, "base_revision": student.revision, "base_config_sha256": student.config_sha256,
        "quantization_while_training": source.recipe.models.student.quantization,
        "adapter_sha256": adapter_sha256, "checkpoint_adapter_sha256": source.checkpoint.adapter_sha256,
        "verify_baseline": msgspec.to_builtins(manifest.verify_baseline) if manifest else None,
        "verify": msgspec.to_builtins(manifest.verify) if manifest else None,
        "quality_gate": msgspec.to_builtins(manifest.quality_gate) if manifest else None,
        "merged_dtype": merged_dtype,
    }
    return json.dumps(document, indent=2, sort_keys=True).encode()


def export_adapter(run_id: str, runs_dir: Path, out: Path, step: int | None, merge: bool, force: bool) -> Exported:
    run, recipe = open_run(run_id, runs_dir)
    source = read_checkpoint(run, recipe, step)
    _check_out(out, force)
    s = recipe.models.student
    student_dir = locate_model("student", s.id, s.revision, s.path)
    _check_base(source, student_dir)
    quiet_libraries()
    model = student_on_cpu(student_dir, msgspec.convert(source.checkpoint.lora, LoraSpec), source.adapter)
    recipe_text = (run.root / layout.RECIPE_FILE).read_text(encoding="utf-8")
    try:
        with directory_atomically(out, force, "export") as folder:
            save_adapter(model, folder, s)
            copy_tokenizer(student_dir, folder)
            kill_point("export:adapter-saved")
            merged_dtype = None
            if merge:
                merged_dtype = save_merged(model, folder / MERGED_DIR, student_dir)
                copy_tokenizer(student_dir, folder / MERGED_DIR)
                kill_point("export:merged-saved")
            digest = sha256_file(folder / ADAPTER_WEIGHTS)
            # peft wrote a template card; ours replaces it.
            (folder / "README.md").write_text(model_card(source, digest, recipe_text, merged_dtype), encoding="utf-8")
            (folder / PROVENANCE_FILE).write_bytes(_provenance(source, digest, merged_dtype))
            readable_by_all(folder)
            kill_point("export:card-written")
    except OSError as exc:
        if exc.errno in _PLACE_ERRORS:
            raise UserError(f"cannot write --out {out}: {exc.strerror or exc}; choose a directory you can write") from None
        raise DiskWriteError(exc.errno or 0, f"could not write {out}: {exc.strerror or exc}; nothing was left "
                                             f"behind") from exc
    return Exported(out, source.step, source.finished, digest, out / MERGED_DIR if merge else None)
