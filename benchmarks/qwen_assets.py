"""Random-weight Qwen3-0.6B / Qwen3-1.7B models at the published shapes, built locally (no hub).

Each model directory gets Qwen3's real tokenizer files and generation config,
and weights saved from the published config (all from `tests/fixtures/qwen3/`,
copied from the hub repositories), so both tokenize byte for byte as the real
models do; the shared recipe also gets a random frozen teacher adapter. Used by
`qwen_pipeline.py` and `rollout_share.py`.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN3_FILES = ROOT / "tests" / "fixtures" / "qwen3"
MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
CONFIGS = {"qwen3-0.6b": "config-Qwen3-0.6B.json", "qwen3-1.7b": "config-Qwen3-1.7B.json"}
TOKENIZER_SIZE = 151_669  # len(tokenizer): 151,643 BPE entries + 26 added tokens; the models have 151,936 rows


def build_model(name: str, out_dir: Path, seed: int) -> None:
    """Random bf16 weights at the published shape, initialised on the GPU; padded rows zeroed."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config.from_json_file(str(QWEN3_FILES / CONFIGS[name]))  # the published file (bfloat16)
    torch.manual_seed(seed)
    with torch.device(_device()):
        model = Qwen3ForCausalLM(config)
    model.to(torch.bfloat16)
    with torch.no_grad():
        model.get_input_embeddings().weight[TOKENIZER_SIZE:].zero_()
    model.save_pretrained(str(out_dir))
    for file in MODEL_FILES:  # after save_pretrained, which writes a generation_config.json of its own
        shutil.copyfile(QWEN3_FILES / file, out_dir / file)
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
    """The models `keys` need (calc: both; shared: the 0.6B) and the shared recipe's teacher adapter."""
    started = time.perf_counter()
    dirs = {name: work / name for name in CONFIGS}
    for seed, (name, directory) in enumerate(dirs.items()):
        if name == "qwen3-0.6b" or "calc" in keys:
            build_model(name, directory, seed)
    assets = {"dirs": {k: str(v) for k, v in dirs.items()}}
    if "shared" in keys:
        assets["adapter_dir"] = str(work / "teacher-adapter")
        assets["adapter_sha256"] = build_teacher_adapter(dirs["qwen3-0.6b"], work / "teacher-adapter")
    built = [d for d in dirs.values() if d.is_dir()]
    assets["tokenizer_files_identical_across_models"] = all(
        (d / name).read_bytes() == (QWEN3_FILES / name).read_bytes() for d in built for name in MODEL_FILES)
    assets["seconds"] = round(time.perf_counter() - started, 1)
    return assets
