"""Preflight's tokenizer pairing on Qwen3's real files (tests/fixtures/qwen3/).

`check_pairing` accepts a student and a teacher only when their tokenizer
files are byte-identical and both output vocabularies cover the tokenizer.
Qwen3-0.6B and Qwen3-1.7B ship the same tokenizer, so directories built from
the real files pair. One byte changed in one of them must refuse the pair.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pytest

from miniverl.engine.core.errors import IncompatibleModelsError
from miniverl.engine.models.loading import check_pairing, require_pairing
from qwen3_fixture import FIXTURE_DIR, MODEL_ROWS, SHA256, TOKENIZER_SIZE, make_model_dir, qwen3_tokenizer

DIFFERENT = "tokenizers differ between student and teacher"


@pytest.fixture
def pair(tmp_path) -> tuple[Path, Path]:
    return make_model_dir(tmp_path / "student", "0.6B"), make_model_dir(tmp_path / "teacher", "1.7B")


def test_the_fixture_files_are_the_published_ones():
    for name, digest in SHA256.items():
        assert hashlib.sha256((FIXTURE_DIR / name).read_bytes()).hexdigest() == digest, name
    table = dict(re.findall(r"^\| (\S+) \| ([0-9a-f]{64}) \|", (FIXTURE_DIR / "README.md").read_text(), re.M))
    assert table == SHA256


def test_the_real_qwen3_pair_passes(pair):
    student, teacher = pair
    assert len(qwen3_tokenizer()) == TOKENIZER_SIZE
    pairing = check_pairing(student, teacher, TOKENIZER_SIZE)
    require_pairing(pairing)
    assert pairing.compatible and pairing.student_sha256 == pairing.teacher_sha256
    assert (pairing.student_rows, pairing.teacher_rows) == (MODEL_ROWS, MODEL_ROWS)
    assert pairing.reason == f"identical tokenizers; rows {TOKENIZER_SIZE}..{MODEL_ROWS - 1} are padding and excluded"


def _change_one_byte(path: Path, old: bytes, new: bytes) -> None:
    """Replace the first `old` with `new` (same length, one byte apart), leaving every other byte."""
    data = path.read_bytes()
    assert len(old) == len(new) and sum(a != b for a, b in zip(old, new)) == 1 and old in data
    changed = data.replace(old, new, 1)
    assert sum(a != b for a, b in zip(data, changed)) == 1
    path.write_bytes(changed)


def _refused(student: Path, teacher: Path) -> None:
    pairing = check_pairing(student, teacher, TOKENIZER_SIZE)
    assert not pairing.compatible and pairing.student_sha256 != pairing.teacher_sha256
    assert pairing.reason.startswith(DIFFERENT)
    with pytest.raises(IncompatibleModelsError, match=f"incompatible: {DIFFERENT}"):
        require_pairing(pairing)


def test_one_byte_of_tokenizer_json_refuses_the_pair(pair):
    student, teacher = pair
    # The third merge rule, "i" + "n", becomes "i" + "m": still valid JSON, but another tokenizer.
    _change_one_byte(teacher / "tokenizer.json", b'[\n        "i",\n        "n"\n      ]',
                     b'[\n        "i",\n        "m"\n      ]')
    _refused(student, teacher)
    _refused(teacher, student)  # whichever side it is




def test_one_character_of_the_chat_template_refuses_the_pair(pair):
    student, teacher = pair
    # The generation prompt's think block: '<think>\n\n</think>\n\n' becomes '<think>\n\n</think>\n\t'.
    # (In the file the template is a JSON string, so its Jinja escapes are written with two backslashes.)
    _change_one_byte(teacher / "tokenizer_config.json", b"{{- '<think>\\\\n\\\\n</think>\\\\n\\\\n' }}",
                     b"{{- '<think>\\\\n\\\\n</think>\\\\n\\\\t' }}")
    _refused(student, teacher)


def test_a_copy_of_the_fixture_pairs_with_a_tiny_random_model(tmp_path):
    """`make_model_dir(tiny=True)` keeps the real tokenizer files and the real vocabulary; padded rows are zero."""
    import torch

    from miniverl.engine.models.loading import load_causal_lm

    tiny = make_model_dir(tmp_path / "tiny", tiny=True)
    plain = tmp_path / "plain"
    shutil.copytree(FIXTURE_DIR, plain)
    shutil.copyfile(plain / "config-Qwen3-1.7B.json", plain / "config.json")
    assert check_pairing(tiny, plain, TOKENIZER_SIZE).compatible
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tiny / name).read_bytes() == (FIXTURE_DIR / name).read_bytes(), name
    model = load_causal_lm(tiny, torch.float32, "cpu")
    embedding = model.get_input_embeddings().weight
    assert embedding.shape == (MODEL_ROWS, 64)
    assert not embedding[TOKENIZER_SIZE:].any() and embedding[:TOKENIZER_SIZE].abs().sum() > 0
    ids = qwen3_tokenizer()("<|im_start|>user\nWie viel ist 3 × 4?<|im_end|>", add_special_tokens=False).input_ids
    assert model(input_ids=torch.tensor([ids])).logits.shape == (1, len(ids), MODEL_ROWS)
