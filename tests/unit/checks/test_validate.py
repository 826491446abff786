"""`miniverl validate` in-process: every problem at once, defaults standing in for failed keys, no repeats."""

from __future__ import annotations

import yaml

from support import SMALL, recipe_dict
from miniverl.engine.checks.validate import validate_text


def _validate(**overrides):
    return validate_text(yaml.safe_dump(recipe_dict(**{**SMALL, **overrides}), sort_keys=False), "recipe.yaml")


def test_a_good_recipe_resolves_and_locates_its_models():
    result = _validate()
    assert result.problems == [] and result.recipe is not None
    assert result.resolved["models.device"].value == "cpu"
    assert set(result.model_dirs) == {"student", "teacher"}


def test_every_schema_problem_is_listed_once():
    result = _validate(**{"train.cyclez": 3, "loss.chunk_size": 0, "rollout.top_p": 1.5, "name": 7})
    assert result.problems == [
        "recipe key name: expected string; got integer 7",
        "recipe key train.cyclez: unknown key (README.md lists the recipe keys)",
        "recipe key rollout.top_p: expected number > 0 and <= 1; got number 1.5",
        "recipe key loss.chunk_size: expected integer >= 1 and <= 1048576; got integer 0",
    ]
    assert result.recipe is None


def test_failed_keys_fall_back_to_defaults_and_are_not_named_twice():
    # min_chunk_size 0 fails; its default (16) then exceeds chunk_size 8, a rule naming the same key: not repeated.
    result = _validate(**{"loss.chunk_size": 8, "memory.min_chunk_size": 0})
    assert result.problems == ["recipe key memory.min_chunk_size: expected integer >= 1 and <= 1048576; got integer 0"]
    # A key that passed is still judged by the rules spanning several keys, and by the machine.
    result = _validate(**{"loss.topk": 0, "memory.min_chunk_size": 512, "optimizer.name": "paged_adamw_8bit"})
    assert result.problems[0] == "recipe key loss.topk: expected integer >= 1 and <= 4096; got integer 0"
    assert any(p.startswith("recipe key memory.min_chunk_size: 512 is above loss.chunk_size") for p in result.problems)
    assert any(p.startswith("recipe key optimizer.name: paged_adamw_8bit needs a CUDA device") for p in result.problems)
    assert len(result.problems) == 3


def test_a_bad_list_entry_drops_the_list_and_the_rest_is_still_checked():
    result = _validate(**{"models.student.lora.target_modules": ["q_proj", 3], "models.device": "cuda"})
    assert result.problems[0] == "recipe key models.student.lora.target_modules.1: expected string; got integer 3"
    if len(result.problems) == 2:  # without a usable GPU, the device is refused in the same pass
        assert result.problems[1].startswith("recipe key models.device: cuda requested")


def test_a_missing_required_key_stops_after_the_schema():
    data = recipe_dict(**SMALL)
    del data["models"]["teacher"]
    data["seed"] = -1
    result = validate_text(yaml.safe_dump(data, sort_keys=False), "recipe.yaml")
    assert result.problems == [
        "recipe key seed: expected integer >= 0; got integer -1",
        "recipe key models.teacher: missing required key; add it (README.md lists the recipe keys)",
    ]
    assert result.recipe is None and result.resolved == {}


def test_yaml_that_is_not_a_recipe():
    assert validate_text("name: [unclosed", "r.yaml").problems == ["r.yaml: not valid YAML at line 1; fix the syntax"]
    assert "YAML mapping" in validate_text("- a\n- b\n", "r.yaml").problems[0]


def test_planned_autos_say_where_they_are_resolved():
    from miniverl.engine.checks.validate import resolved_rows

    data = recipe_dict(**{**SMALL, "train.trajectory_batch_size": "auto", "memory.budget": "auto"})
    rows = {key: (value, note) for key, value, note in resolved_rows(validate_text(yaml.safe_dump(data), "r.yaml"))}
    assert rows["train.trajectory_batch_size"][0] == "auto" and "--dry-run" in rows["train.trajectory_batch_size"][1]
    assert "free memory less a margin" in rows["memory.budget"][1]
    assert rows["rollout.generation_batch_size"] == (str(SMALL["rollout.generation_batch_size"]), "")
