"""Fixtures shared by every test directory; helpers live in support.py.

Everything under tests/e2e/ runs the real command in a subprocess, usually a
whole pipeline, so it is marked `slow`: `pytest -m "not slow"` is the
edit-test loop (unit tests only), plain `pytest` runs everything.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support import SMALL, recipe_dict, write_recipe

E2E = Path(__file__).parent / "e2e"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if E2E in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def small_recipe(tmp_path: Path) -> Path:
    return write_recipe(tmp_path, recipe_dict(**SMALL))
