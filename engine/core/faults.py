"""Fault injection for tests: real OOM errors and real SIGKILLs at named points.

Set by environment variables so a test can drive a real `miniverl` subprocess:
- MINIVERL_FAULT_OOM_ABOVE=N: a loss chunk whose logits exceed N elements
  raises the real `torch.OutOfMemoryError`, as a GPU that cannot fit it would.
- MINIVERL_FAULT_KILL_AT=NAME[#K]: the process SIGKILLs itself the K-th time
  (default first) it reaches the kill point NAME. Writes are kill points too:
  `write:FILE` fires after FILE's new bytes are fsynced, before the rename;
  `tear:journal.log` after half of a journal record reaches the disk.
- MINIVERL_FAULT_ENOSPC_AT=FILE[#K]: the K-th write of FILE fails with the
  real ENOSPC OSError, as a full disk would.
"""

from __future__ import annotations

import errno
import os
import signal
from typing import BinaryIO

import torch

_hits: dict[str, int] = {}


def oom_guard(elements: int) -> None:
    limit = os.environ.get("MINIVERL_FAULT_OOM_ABOVE")
    if limit is not None and elements > int(limit):
        raise torch.OutOfMemoryError(f"injected: {elements} logit elements exceed the cap of {limit}")


def _nth_hit(variable: str, name: str) -> bool:
    """True the K-th time `name` is reached, where $variable is NAME[#K]."""
    target = os.environ.get(variable)
    if not target:
        return False
    point, _, nth = target.partition("#")
    if point != name:
        return False
    key = f"{variable}/{name}"
    _hits[key] = _hits.get(key, 0) + 1
    return _hits[key] == int(nth or 1)


def kill_point(name: str) -> None:
    if _nth_hit("MINIVERL_FAULT_KILL_AT", name):
        os.kill(os.getpid(), signal.SIGKILL)


def tear_point(name: str, handle: BinaryIO, data: bytes) -> None:
    """A kill point inside an append: `tear:NAME` writes half of `data` to the disk, then SIGKILLs."""
    if _nth_hit("MINIVERL_FAULT_KILL_AT", f"tear:{name}"):
        handle.write(data[: len(data) // 2])
        handle.flush()
        os.fsync(handle.fileno())
        os.kill(os.getpid(), signal.SIGKILL)


def disk_fault(name: str) -> None:
    if _nth_hit("MINIVERL_FAULT_ENOSPC_AT", name):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
