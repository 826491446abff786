"""The layout: the plan's order, stage ids both ways, and where each reference points."""

from __future__ import annotations

import pytest

from miniverl.engine.core import layout
from miniverl.engine.core.errors import UserError
from miniverl.engine.core.layout import StageKey


def test_the_plan_is_sorted_by_order_and_its_length_is_arithmetic() -> None:
    for cycles in (0, 1, 3):
        keys = list(layout.plan(cycles))
        assert len(keys) == layout.plan_length(cycles)
        assert [k.order for k in keys] == sorted(k.order for k in keys)
        assert len({k.id for k in keys}) == len(keys)
    assert [k.id for k in layout.plan(1)] == [
        "preflight", "verify@baseline", "c000000/rollout", "c000000/teacher_score", "c000000/gradient",
        "c000000/optimizer_step", "verify@final", "manifest"]


def test_the_plan_is_computed_not_materialised() -> None:
    plan = layout.plan(10**9)
    assert [next(plan).id for _ in range(3)] == ["preflight", "verify@baseline", "c000000/rollout"]


def test_stage_ids_parse_back() -> None:
    for key in layout.plan(2):
        assert StageKey.parse(key.id) == key
        assert layout.stage_order(key.id) == key.order
    assert layout.stage_order("not/a-stage") == (9, 0, 0)


def test_every_input_is_produced_earlier_in_the_plan() -> None:
    """The driver can only read what a stage before it wrote."""
    from miniverl.engine.run.driver import STAGES  # the test may look across layers
    from miniverl.engine.core.recipe import parse_recipe
    import yaml
    from support import SMALL, recipe_dict

    recipe = parse_recipe(yaml.safe_dump(recipe_dict(**SMALL)))
    produced: dict[str, StageKey] = {}
    for key in layout.plan(recipe.train.cycles):
        for ref in STAGES[key.name].inputs(key, recipe).values():
            assert ref.path in produced, f"{key.id} reads {ref.path}, which no earlier stage writes"
            assert produced[ref.path] == ref.producer
        for ref in STAGES[key.name].outputs(key, recipe):
            assert ref.producer == key and ref.path not in produced
            produced[ref.path] = key


def test_key_for_names_what_is_wrong() -> None:
    assert layout.key_for("gradient", 1, None, 2) == StageKey("gradient", 1)
    assert layout.key_for("verify", None, None, 2) == StageKey("verify", label="final")
    with pytest.raises(UserError, match="needs --cycle K"):
        layout.key_for("rollout", None, None, 2)
    with pytest.raises(UserError, match="out of range"):
        layout.key_for("rollout", 2, None, 2)
    with pytest.raises(UserError, match="unknown stage 'train'"):
        layout.key_for("train", None, None, 2)
    with pytest.raises(UserError, match="--label baseline or --label final"):
        layout.key_for("verify", None, "middle", 2)


def test_checkpoints_and_what_inspect_shows() -> None:
    assert layout.checkpoint_ref(0).producer == StageKey("preflight")
    assert layout.checkpoint_ref(3).producer == StageKey("optimizer_step", 2)
    assert layout.shown_artifact("optimizer_step", 2).path == "checkpoints/000003/checkpoint.msgpack"
    assert layout.shown_artifact("verify", None, "baseline").path == "verify/baseline.msgpack"
    with pytest.raises(UserError, match="needs --cycle K"):
        layout.shown_artifact("gradient", None)
    with pytest.raises(UserError, match="inspect knows the stages"):
        layout.shown_artifact("manifest", None)
