"""Fixtures shared by every test directory; helpers live in support.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from support import SMALL, recipe_dict, write_recipe


@pytest.fixture
def small_recipe(tmp_path: Path) -> Path:
    return write_recipe(tmp_path, recipe_dict(**SMALL))
