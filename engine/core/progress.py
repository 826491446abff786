"""Progress for long stages: rich bars on a terminal, silence otherwise."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console(stderr=True)


class Reporter:
    def __init__(self, enabled: bool | None = None):
        self.enabled = console.is_terminal if enabled is None else enabled

    @contextmanager
    def bar(self, description: str, total: int, unit: str) -> Iterator[Callable[[int], None]]:
        """Yield `advance(n)`; shows `done/total unit` while the stage runs."""
        if not self.enabled:
            yield lambda n: None
            return
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn(unit), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task(description, total=total)
            yield lambda n: progress.advance(task, n)

    def line(self, text: str) -> None:
        if self.enabled:
            console.print(text)
        else:
            print(text, file=sys.stderr)
