"""One small error hierarchy. User-caused errors carry a hint and exit 2."""

from __future__ import annotations


class MiniverlError(Exception):
    """Base of every error miniverl raises on purpose."""

    exit_code = 1


class UserError(MiniverlError):
    """Something the user can fix: the message names it and says how."""

    exit_code = 2


class RecipeError(UserError, ValueError):
    """A recipe key is unknown, mistyped or out of range."""


class IncompatibleModelsError(UserError, ValueError):
    """Student and teacher cannot be paired (tokenizer, vocabulary, base revision)."""


class RunStateError(UserError, RuntimeError):
    """The run directory is missing, held by another process, or unusable."""


class ArtifactError(MiniverlError, RuntimeError):
    """An artifact failed its schema or content-hash check."""


class ArtifactPruned(UserError, RuntimeError):
    """An artifact the run removed by its retention policy (`checkpoints`, `artifacts`)."""


class StageFailed(MiniverlError, RuntimeError):
    """A stage raised; the run stops and can be resumed."""
