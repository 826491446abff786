"""Shared test helpers: small recipes over the embedded tiny models, and the real CLI in a subprocess.

Imported by tests as `support` (pyproject puts tests/ on the path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def recipe_dict(name: str = "tiny_calc.yaml", /, **overrides) -> dict:
    """A shipped recipe with dotted-key overrides, e.g. {"train.cycles": 2}."""
    data = yaml.safe_load((ROOT / "recipes" / name).read_text())
    for dotted, value in overrides.items():
        node = data
        keys = dotted.split(".")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return data


SMALL = {
    "train.cycles": 2,
    "train.rollouts_per_cycle": 8,
    "train.trajectory_batch_size": 4,
    "task.heldout_size": 8,
    "rollout.generation_batch_size": 8,
    "verify.batch_size": 8,
    "models.device": "cpu",
}


def write_recipe(tmp_path: Path, data: dict, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def miniverl(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """The real command, as a user runs it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("MINIVERL_FAULT_KILL_AT", None) if env is None or "MINIVERL_FAULT_KILL_AT" not in env else None
    return subprocess.run([sys.executable, "-m", "miniverl.engine.cli.app", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=ROOT)


def manifest(runs_dir: Path, run_id: str) -> dict:
    return json.loads((runs_dir / run_id / "manifest.json").read_text())


def drive_by_hand(loop, item, turns: list[str]):
    """A `ToolLoop` episode whose model turns are the given texts, token by token (no model at all)."""
    episode = loop.start(item)
    scripts = [loop.tokenizer(t, add_special_tokens=False).input_ids for t in turns]
    while not episode.finished:
        if episode.pending:
            loop.feed_forced(episode)
        else:
            loop.feed_sampled(episode, scripts[len(episode.turns)][len(episode.turn_tokens)], 0.0)
    return episode
