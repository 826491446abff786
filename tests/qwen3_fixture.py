"""Qwen3's real tokenizer and configs (tests/fixtures/qwen3/) for tests that must behave as the real models do.

Imported by tests as `qwen3_fixture` (pyproject puts tests/ on the path). No
weights ship with the fixture. `make_model_dir` writes a model directory the
way a hub snapshot looks, and with `tiny=True` it adds a small random-weight
Qwen3 that keeps the real vocabulary (151,936 rows).
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

FIXTURE_DIR = Path(__file__).resolve().parent / "fixtures" / "qwen3"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MODEL_FILES = (*TOKENIZER_FILES, "generation_config.json")  # what a model directory gets besides config.json
CONFIGS = {"0.6B": "config-Qwen3-0.6B.json", "1.7B": "config-Qwen3-1.7B.json"}
TOKENIZER_SIZE = 151_669  # 151,643 BPE entries + 26 added tokens; the models have 151,936 rows
MODEL_ROWS = 151_936
SHA256 = {  # as published on the hub (fixtures/qwen3/README.md)
    "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    "tokenizer_config.json": "d5d09f07b48c3086c508b30d1c9114bd1189145b74e982a265350c923acd8101",
    "generation_config.json": "2325da0f15bb848e018c5ae071b7943332e9f871d6b60e2ed22ca97d4cb993d2",
    "config-Qwen3-0.6B.json": "660db3b73d788119c04535e48cf9be5f55bc3100841a718637ae695b442f27dd",
    "config-Qwen3-1.7B.json": "1ddb5b89ebc90dcb417a45c213d818577e65976454d29385c8f6140771d95197",
    "LICENSE": "832dd9e00a68dd83b3c3fb9f5588dad7dcf337a0db50f7d9483f310cd292e92e",
}


@functools.lru_cache(maxsize=1)
def qwen3_tokenizer() -> Any:
    """The real tokenizer, loaded once per process the way the engine loads one (share it, never mutate it)."""
    from miniverl.engine.models.loading import load_tokenizer

    return load_tokenizer(FIXTURE_DIR)


def real_config(which: str = "0.6B") -> dict[str, Any]:
    return json.loads((FIXTURE_DIR / CONFIGS[which]).read_text())


def make_model_dir(dest: Path, which: str = "0.6B", tiny: bool = False, *, hidden_size: int = 64, seed: int = 0,
                   dtype: str = "float32") -> Path:
    """A model directory: the real tokenizer files, generation config and `which`'s config.json.

    Without `tiny`, config.json is the published file byte for byte and there
    are no weights, which is enough for anything that reads only files
    (tokenizer pairing, config checks). With `tiny`, the config keeps
    everything but the size (2 layers, `hidden_size`, 4 heads, 2 KV heads) and
    random weights drawn from `seed` are saved in `dtype`. The rows past the
    tokenizer are zeroed, as padding rows of a real checkpoint carry nothing.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if tiny:
        _save_tiny_model(dest, which, hidden_size, seed, dtype)
    else:
        shutil.copyfile(FIXTURE_DIR / CONFIGS[which], dest / "config.json")
    for name in MODEL_FILES:  # after save_pretrained, which writes its own generation_config.json
        shutil.copyfile(FIXTURE_DIR / name, dest / name)
    return dest


def _save_tiny_model(dest: Path, which: str, hidden_size: int, seed: int, dtype: str) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2, max_window_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4)
    config = Qwen3Config.from_dict({**real_config(which), **shape, "torch_dtype": dtype})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    with torch.no_grad():
        model.get_input_embeddings().weight[TOKENIZER_SIZE:].zero_()
    model.save_pretrained(str(dest))
