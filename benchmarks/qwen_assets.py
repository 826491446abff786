"""Random-weight Qwen3-0.6B / Qwen3-1.7B models at the published shapes, built locally (no hub).

Both model directories get byte-identical tokenizer files of Qwen3's shape
(`qwen_tokenizer.py`); the shared recipe also gets a random frozen teacher adapter.
Used by `qwen_pipeline.py` and `rollout_share.py`.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

from qwen_tokenizer import TOKENIZER_SIZE, build_tokenizer

ROOT = Path(__file__).resolve().parents[1]
COMMON_CONFIG = dict(
    vocab_size=151936, tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    max_position_embeddings=40960, hidden_act="silu", attention_bias=False, attention_dropout=0.0,
    use_sliding_window=False, bos_token_id=151643, eos_token_id=151645, initializer_range=0.02,
)
SHAPES = {  # the published configurations (config.json of each hub repository)
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
}



def build_model(name: str, tokenizer_dir: Path, out_dir: Path, seed: int) -> None:
    """Random bf16 weights at the published shape, initialised on the GPU; padded rows zeroed."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**COMMON_CONFIG, **SHAPES[name], dtype="bfloat16")
    torch.manual_seed(seed)
    with torch.device(_device()):
        model = Qwen3ForCausalLM(config)
    model.to(torch.bfloat16)
    with torch.no_grad():
        model.get_input_embeddings().weight[TOKENIZER_SIZE:].zero_()
    model.save_pretrained(str(out_dir))
    for file in tokenizer_dir.iterdir():
        shutil.copyfile(file, out_dir / file.name)
    del model
    torch.cuda.empty_cache()


def build_teacher_adapter(base_dir: Path, out_dir: Path, seed: int = 1) -> str:
    """A random LoRA (the shared recipe's shape) for the 0.6B base; returns its weights' sha256."""
    import torch
    import yaml

    from miniverl.engine.models.loading import attach_lora, load_causal_lm
    from miniverl.engine.core.recipe import LoraSpec

    spec = yaml.safe_load((ROOT / "recipes" / "qwen_consumer_gpu_shared.yaml").read_text())["models"]["student"]["lora"]
    model = attach_lora(load_causal_lm(base_dir, torch.bfloat16, _device()), LoraSpec(**spec), seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.01 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(str(out_dir))
    del model
    torch.cuda.empty_cache()
    return hashlib.sha256((out_dir / "adapter_model.safetensors").read_bytes()).hexdigest()


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"  # CPU only to check this script on tiny shapes


def build_assets(work: Path, keys: tuple[str, ...]) -> dict:
    """The tokenizer, the models `keys` need (calc: both; shared: the 0.6B), the shared recipe's teacher adapter."""
    started = time.perf_counter()
    tokenizer_dir = work / "tokenizer"
    build_tokenizer(tokenizer_dir, ROOT / "README.md")
    dirs = {name: work / name for name in SHAPES}
    for seed, (name, directory) in enumerate(dirs.items()):
        if name == "qwen3-0.6b" or "calc" in keys:
            build_model(name, tokenizer_dir, directory, seed)
    assets = {"dirs": {k: str(v) for k, v in dirs.items()}}
    if "shared" in keys:
        assets["adapter_dir"] = str(work / "teacher-adapter")
        assets["adapter_sha256"] = build_teacher_adapter(dirs["qwen3-0.6b"], work / "teacher-adapter")
    built = [d for d in dirs.values() if d.is_dir()]
    assets["tokenizer_files_identical_across_models"] = all(
        (built[0] / f.name).read_bytes() == (d / f.name).read_bytes() for d in built for f in tokenizer_dir.iterdir())
    assets["seconds"] = round(time.perf_counter() - started, 1)
    return assets
