"""The shipped tiny models of each family: config facts and a quick greedy behaviour check in the rollout/verify loop."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from miniverl.engine.tasks.protocol import TOOL_CALL_OPEN  # noqa: E402
from miniverl.engine.tiny.evaluate import evaluate_greedy  # noqa: E402
from miniverl.engine.tiny.models import (  # noqa: E402
    FAMILIES,
    MODEL_NAMES,
    MODEL_VOCAB_SIZE,
    TOKENIZER_SIZE,
    asset_dir,
    load_model,
    load_tokenizer,
)
from miniverl.engine.tiny.train import build_family_task  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def tokenizer(family):
    return load_tokenizer(family=family)


@pytest.fixture(scope="module")
def models(family):
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return {name: load_model(name, family=family) for name in MODEL_NAMES}


@pytest.fixture(scope="module")
def task(family):
    return build_family_task(family)


@pytest.fixture(scope="module")
def heldout(task):
    return task.items("heldout", 20, seed=7)


def test_the_calculator_constants_are_its_family():
    calculator = FAMILIES["calculator"]
    assert (TOKENIZER_SIZE, MODEL_VOCAB_SIZE) == (calculator.tokenizer_size, calculator.model_vocab_size) == (397, 448)
    assert calculator.builtin_id("student_base") == "miniverl-builtin/student_base"
    assert FAMILIES["sql"].builtin_id("student_base") == "miniverl-builtin/sql/student_base"


def test_vocab_sizes_are_what_the_shipped_files_hold(family, tokenizer, models):
    """The sizes the code masks with must be the real tokenizer's and embeddings' sizes."""
    assert len(tokenizer) == family.tokenizer_size
    for model in models.values():
        assert model.get_input_embeddings().weight.shape[0] == family.model_vocab_size > family.tokenizer_size
        assert model.config.vocab_size == family.model_vocab_size


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_asset_files(family, name):
    directory = family.asset_dir(name)
    assert (directory / "config.json").is_file()
    weights = directory / "model.safetensors"
    assert weights.is_file()
    assert weights.stat().st_size < 5 * 1024 * 1024
    for filename in TOKENIZER_FILES:
        shipped = (family.asset_dir("tokenizer") / filename).read_bytes()
        assert (directory / filename).read_bytes() == shipped, f"{name}/{filename} differs from the shared tokenizer"


def test_asset_dir_rejects_unknown_names():
    with pytest.raises(ValueError):
        asset_dir("nope")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_config_facts(family, name, models, tokenizer):
    model = models[name]
    config = model.config
    assert config.model_type == "qwen3"
    assert config.vocab_size == family.model_vocab_size
    assert config.tie_word_embeddings is True
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    assert config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert config.pad_token_id == tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert model.dtype == torch.float32
    # Padded vocabulary rows were never trained: still exactly zero.
    assert not model.get_input_embeddings().weight[family.tokenizer_size:].any()


def test_teachers_share_a_config(models):
    teacher, raw = models["protocol_teacher"].config, models["raw_teacher"].config
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
        assert getattr(teacher, key) == getattr(raw, key)
    student = models["student_base"].config
    assert student.hidden_size < teacher.hidden_size


def test_protocol_teacher_uses_the_tool(models, tokenizer, task, heldout):
    metrics = evaluate_greedy(models["protocol_teacher"], tokenizer, task, heldout)
    assert metrics["strict_success"] >= 0.9, metrics


@pytest.mark.parametrize("name", ["raw_teacher", "student_base"])
def test_direct_answerers_never_call_the_tool(name, models, tokenizer, task, heldout):
    metrics = evaluate_greedy(models[name], tokenizer, task, heldout)
    assert metrics["tool_call_rate"] == 0.0, metrics
    assert metrics["finished"] == 1.0, metrics


def test_student_completes_a_tool_call_it_was_made_to_open(models, tokenizer, task, heldout):
    """The decision to call the tool is what the base student lacks, not the skill (see `tiny.train`)."""
    metrics = evaluate_greedy(models["student_base"], tokenizer, task, heldout, first_turn_prefix=TOOL_CALL_OPEN)
    assert metrics["strict_success"] >= 0.9, metrics
