"""Fault injection for tests: real OOM errors and real SIGKILLs at named points.

Set by environment variables so a test can drive a real `miniverl` subprocess:
- MINIVERL_FAULT_OOM_ABOVE=N: a loss chunk whose logits exceed N elements
  raises the real `torch.OutOfMemoryError`, as a GPU that cannot fit it would.
- MINIVERL_FAULT_KILL_AT=NAME[#K]: the process SIGKILLs itself the K-th time
  (default first) it reaches the kill point NAME.
"""

from __future__ import annotations

import os
import signal

import torch

_hits: dict[str, int] = {}


def oom_guard(elements: int) -> None:
    limit = os.environ.get("MINIVERL_FAULT_OOM_ABOVE")
    if limit is not None and elements > int(limit):
        raise torch.OutOfMemoryError(f"injected: {elements} logit elements exceed the cap of {limit}")


def kill_point(name: str) -> None:
    target = os.environ.get("MINIVERL_FAULT_KILL_AT")
    if not target:
        return
    point, _, nth = target.partition("#")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
