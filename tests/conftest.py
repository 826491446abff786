"""Fixtures shared by every test directory; helpers live in support.py.

Everything under tests/e2e/ runs the real command in a subprocess, usually a
whole pipeline, so it is marked `slow`: `pytest -m "not slow"` is the
edit-test loop (unit tests only), plain `pytest` runs everything.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support import SMALL, recipe_dict, write_recipe

E2E = Path(__file__).parent / "e2e"


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist there is a worker per core: each worker, and each `miniverl` it starts, takes one
    thread. Two-thread torch processes sharing two cores spin against each other and run 5-10x slower.

    Without CUDA, the Triton kernels' tests run them under Triton's interpreter: TRITON_INTERPRET is
    read when a kernel is defined, so it is set here, before any test module imports one."""
    import torch

    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if E2E in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def small_recipe(tmp_path: Path) -> Path:
    return write_recipe(tmp_path, recipe_dict(**SMALL))
