"""The error a user's task file (items or tools) raises: one line naming the file, the line and what to fix."""

from __future__ import annotations

from pathlib import Path

from miniverl.engine.core.errors import UserError


class TaskFileError(UserError, ValueError):
    """A user's task file is missing, malformed or inconsistent; the message is one line and says how to fix it."""


def read_task_file(path: Path, what: str) -> bytes:
    """The file's bytes, or a one-line TaskFileError saying why not (`what` is e.g. "task file")."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise TaskFileError(f"{path}: no such {what}; check the path") from None
    except OSError as exc:
        raise TaskFileError(f"{path}: cannot read the {what}: {exc.strerror or exc}") from None
