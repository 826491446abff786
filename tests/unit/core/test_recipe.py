import copy

import jsonschema
import msgspec
import pytest
import yaml

from miniverl.engine.core.errors import RecipeError
from miniverl.engine.core.recipe import (
    Recipe, load_recipe, parse_recipe, problem_line, schema_problems, text_with_overrides,
)

from support import ROOT
BASE = yaml.safe_load((ROOT / "recipes" / "tiny_calc.yaml").read_text())


def _with(path: str, value, delete=False) -> str:
    data = yaml.safe_load(yaml.safe_dump(BASE))
    node = data
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[key]
    if delete:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return yaml.safe_dump(data)


def test_shipped_recipes_parse():
    for path in (ROOT / "recipes").glob("*.yaml"):
        load_recipe(path)


@pytest.mark.parametrize("path,value,needle", [
    ("train.cyclez", 3, "recipe key train.cyclez: unknown key"),
    ("models.student.lora.rank", 3, "models.student.lora.rank: unknown key"),
    ("train.cycles", "ten", "recipe key train.cycles"),
    ("train.cycles", 0, "recipe key train.cycles"),
    ("loss.chunk_size", -4, "recipe key loss.chunk_size"),
    ("loss.mode", "full", "recipe key loss.mode"),
    ("memory.min_chunk_size", 4096, "memory.min_chunk_size"),
    ("rollout.top_p", 1.5, "recipe key rollout.top_p"),
    ("models.runtime", "shared_backbone", "models.runtime"),
    ("models.device", "tpu", "recipe key models.device"),
])
def test_bad_values_name_the_key(path, value, needle):
    with pytest.raises(RecipeError) as info:
        parse_recipe(_with(path, value))
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_missing_required_key_and_missing_file(tmp_path):
    with pytest.raises(RecipeError, match="recipe key models: missing required key"):
        parse_recipe(_with("models", None, delete=True))
    with pytest.raises(RecipeError, match="recipe key models.student.id: missing required key"):
        parse_recipe(_with("models.student.id", None, delete=True))
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match="not valid YAML"):
        parse_recipe("name: [unclosed")


@pytest.mark.parametrize("path,value,message", [
    ("train.cycles", 0, "recipe key train.cycles: expected integer >= 1 and <= 100000; got integer 0"),
    ("train.cycles", "ten", "recipe key train.cycles: expected integer >= 1 and <= 100000; got string 'ten'"),
    ("train.cycles", 3.0, "recipe key train.cycles: expected integer >= 1 and <= 100000; got number 3.0"),  # as msgspec: no floats
    ("train.gradient_checkpointing", 1, "recipe key train.gradient_checkpointing: expected boolean; got integer 1"),
    ("loss.mode", "full", "recipe key loss.mode: expected one of 'exact', 'sampled_kl', 'topk_tail'; got string 'full'"),
    ("rollout.top_p", 1.5, "recipe key rollout.top_p: expected number > 0 and <= 1; got number 1.5"),
    ("rollout.temperature", float("nan"), "recipe key rollout.temperature: expected number > 0; got number nan"),
    ("models.student.revision", 5, "recipe key models.student.revision: expected string or null; got integer 5"),
    ("models.teacher.adapter", 5, "recipe key models.teacher.adapter: expected a mapping or null; got integer 5"),
    ("models.student.lora.target_modules", ["q_proj", 3],
     "recipe key models.student.lora.target_modules.1: expected string; got integer 3"),
    ("train", [1], "recipe key train: expected a mapping; got a list"),
])
def test_messages_say_what_the_key_expects(path, value, message):
    with pytest.raises(RecipeError) as info:
        parse_recipe(_with(path, value))
    assert str(info.value) == message


def test_every_problem_is_found_at_once_and_parse_raises_the_first():
    data = copy.deepcopy(BASE)  # in the file's key order
    data["train"]["cyclez"] = 3
    data["loss"]["chunk_size"] = 0
    data["models"]["teacher"]["adapter"] = {"path": 3}  # a nested section: its own keys are named
    lines = [problem_line(problem) for problem in schema_problems(data)]
    assert lines == [
        "recipe key models.teacher.adapter.path: expected string; got integer 3",
        "recipe key models.teacher.adapter.base_id: missing required key; add it (README.md lists the recipe keys)",
        "recipe key train.cyclez: unknown key (README.md lists the recipe keys)",
        "recipe key loss.chunk_size: expected integer >= 1 and <= 1048576; got integer 0",
    ]  # in the order the keys appear in the file
    with pytest.raises(RecipeError) as info:
        parse_recipe(yaml.safe_dump(data, sort_keys=False))
    assert str(info.value) == lines[0]


def test_the_schema_is_the_recipe_structs():
    """The JSON Schema checked is msgspec's own view of Recipe: what it accepts, msgspec decodes."""
    schema = msgspec.json.schema(Recipe)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert set(schema["$defs"]["Recipe"]["properties"]) == set(Recipe.__struct_fields__)
    for path in (ROOT / "recipes").glob("*.yaml"):
        data = yaml.safe_load(path.read_text())
        assert schema_problems(data) == [], path
        msgspec.convert(data, Recipe, strict=True)


# ---------------------------------------------------------------- command-line overrides
def _overridden(*items: str) -> dict:
    text = text_with_overrides((ROOT / "recipes" / "tiny_calc.yaml").read_text(), items, "tiny_calc.yaml")
    return msgspec.to_builtins(parse_recipe(text))


def _differences(a, b, prefix=""):
    if isinstance(a, dict) and isinstance(b, dict):
        return sorted(d for key in a.keys() | b.keys() for d in _differences(a.get(key), b.get(key), f"{prefix}{key}."))
    return [prefix.rstrip(".")] if a != b else []


def test_an_override_changes_exactly_its_key_with_the_yaml_type():
    plain = _overridden()
    changed = _overridden("train.cycles=80", "loss.chunk_size=32", "optimizer.lr=3e-4",
                          "models.student.lora.target_modules=[q_proj, v_proj]", "report.tensorboard=true")
    assert _differences(plain, changed) == ["loss.chunk_size", "models.student.lora.target_modules", "optimizer.lr",
                                            "report.tensorboard", "train.cycles"]
    assert (changed["train"]["cycles"], changed["loss"]["chunk_size"], changed["optimizer"]["lr"]) == (80, 32, 3e-4)
    assert changed["models"]["student"]["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert changed["report"]["tensorboard"] is True
    assert _overridden("train.cycles=5", "train.cycles=7")["train"]["cycles"] == 7  # the last one wins
    # A section the file leaves to its defaults is created.
    assert _overridden("checkpoints.keep_last=5")["checkpoints"]["keep_last"] == 5


def test_without_overrides_the_text_is_kept_verbatim():
    text = (ROOT / "recipes" / "tiny_calc.yaml").read_text()
    assert text_with_overrides(text, ()) == text
    written = text_with_overrides(text, ["train.cycles=3"], "tiny_calc.yaml")
    assert written.startswith("# tiny_calc.yaml with command-line overrides: train.cycles=3\n")


@pytest.mark.parametrize("item,needle", [
    ("train.cyclez=3", "recipe key train.cyclez: unknown key"),
    ("train.cycles=abc", "recipe key train.cycles: expected integer"),
    ("train.cycles=0", "recipe key train.cycles: expected integer >= 1"),
    ("loss.mode=fancy", "recipe key loss.mode:"),
    ("seed.x=1", "override seed.x: recipe key seed is not a mapping"),
    ("train.cycles", "override 'train.cycles': expected KEY=VALUE"),
    ("=3", "override '=3': expected KEY=VALUE"),
    ("train..cycles=3", "expected KEY=VALUE"),
    ("task.name=[", "override task.name: '[' is not a YAML value"),
])
def test_a_bad_override_is_one_line_naming_the_dotted_key(item, needle):
    with pytest.raises(RecipeError) as caught:
        _overridden(item)
    assert needle in str(caught.value) and "\n" not in str(caught.value)
