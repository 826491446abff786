
import pytest
import yaml

from miniverl.engine.core.errors import RecipeError
from miniverl.engine.core.recipe import load_recipe, parse_recipe

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
    with pytest.raises(RecipeError, match="missing required key `models`"):
        parse_recipe(_with("models", None, delete=True))
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match="not valid YAML"):
        parse_recipe("name: [unclosed")
