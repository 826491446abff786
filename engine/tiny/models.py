"""The embedded tiny models: configs, construction and where they are shipped.

Each built-in task has a family: a tokenizer and three Qwen3 models, built from
a config (no downloads) and trained on a CPU by `miniverl.engine.tiny.train`,
that stand in for the real teacher/student pair:

- ``protocol_teacher``: calls the task's tool as the oracle does (the
  calculator with the question's expression; `sql` with the question's query),
  then answers by copying the tool result (the behaviour to distil).
- ``raw_teacher``: same size, answers directly and never calls the tool (the
  negative control: distilling from it must not teach tool use).
- ``student_base``: smaller; answers directly and never calls the tool, but
  was pretrained on the protocol, so a small LoRA adapter recovers tool use.

The calculator family lives in ``assets/tiny/`` (recipe ids
``miniverl-builtin/<model>``; tokenizer of 397 tokens, embedding padded to
``padded_vocab_size(397) == 448`` rows), the sql family in ``assets/tiny/sql/``
(``miniverl-builtin/sql/<model>``; 746 tokens, 768 rows). The models of a
family share its tokenizer. Rows are padded past the tokenizer as Qwen3 pads
its own; the padded rows are zero at construction, never receive a gradient
(training masks their logits to -inf) and are never sampled: evaluation, like
rollout and verify, cuts the logits to the tokenizer's rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from miniverl.engine.models import loading
from miniverl.engine.tiny.tokenizer import padded_vocab_size

SQL_TOKENIZER_SIZE = 746  # what `tiny.train --family sql --build-tokenizer` builds

TINY_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny"
TOKENIZER_NAME = "tokenizer"
MODEL_NAMES = ("protocol_teacher", "raw_teacher", "student_base")


@dataclass(frozen=True)
class TinyFamily:
    """One task's tokenizer and three models, shipped together under `root`."""

    task: str  # the task (`tasks.registry` name) the models were trained on
    root: Path
    tokenizer_size: int
    bpe_vocab_size: int

    @property
    def model_vocab_size(self) -> int:
        return padded_vocab_size(self.tokenizer_size)

    def asset_dir(self, name: str) -> Path:
        if name != TOKENIZER_NAME and name not in MODEL_NAMES:
            raise ValueError(f"unknown tiny asset {name!r}; expected one of {(TOKENIZER_NAME, *MODEL_NAMES)}")
        return self.root / name

    def builtin_id(self, name: str) -> str:
        """The recipe id of one model: `miniverl-builtin/student_base`, `miniverl-builtin/sql/student_base`."""
        return "miniverl-builtin/" + str(self.asset_dir(name).relative_to(TINY_DIR))


FAMILIES: dict[str, TinyFamily] = {
    "calculator": TinyFamily("calculator", TINY_DIR, tokenizer_size=397, bpe_vocab_size=440),
    "sql": TinyFamily("sql", TINY_DIR / "sql", tokenizer_size=SQL_TOKENIZER_SIZE, bpe_vocab_size=768),
}
CALCULATOR = FAMILIES["calculator"]
TOKENIZER_SIZE = CALCULATOR.tokenizer_size
MODEL_VOCAB_SIZE = CALCULATOR.model_vocab_size  # 448
PADDED_TOKEN_IDS = tuple(range(TOKENIZER_SIZE, MODEL_VOCAB_SIZE))
ATTN_IMPLEMENTATION = "sdpa"
MAX_POSITION_EMBEDDINGS = 512


@dataclass(frozen=True)
class TinySpec:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int


TEACHER_SPEC = TinySpec(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=384,
)
STUDENT_SPEC = TinySpec(
    hidden_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    intermediate_size=256,
)
SPECS: dict[str, TinySpec] = {
    "protocol_teacher": TEACHER_SPEC,
    "raw_teacher": TEACHER_SPEC,
    "student_base": STUDENT_SPEC,
}


def asset_dir(name: str, family: TinyFamily = CALCULATOR) -> Path:
    """Directory of one shipped asset: a model name or ``"tokenizer"``."""
    return family.asset_dir(name)


def load_tokenizer(path: Path | str | None = None, family: TinyFamily = CALCULATOR) -> Any:
    """The family's shipped tiny tokenizer (or the one at `path`), loaded as every model's is, checked for its size."""
    tokenizer = loading.load_tokenizer(Path(path) if path is not None else family.asset_dir(TOKENIZER_NAME))
    if len(tokenizer) != family.tokenizer_size:
        raise ValueError(f"tiny tokenizer has {len(tokenizer)} tokens, expected {family.tokenizer_size}")
    return tokenizer


def build_config(spec: TinySpec, tokenizer: Any) -> Any:
    from transformers import Qwen3Config

    pad_id = tokenizer.pad_token_id  # <|endoftext|>
    config = Qwen3Config(
        vocab_size=padded_vocab_size(len(tokenizer)),
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        tie_word_embeddings=True,
        # Qwen3 uses <|endoftext|> as bos and pad; the tiny tokenizer has no bos token.
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else pad_id,
        eos_token_id=tokenizer.eos_token_id,  # <|im_end|>
        pad_token_id=pad_id,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        attention_dropout=0.0,
        **asdict(spec),
    )
    config._attn_implementation = ATTN_IMPLEMENTATION
    return config


def build_model(spec: TinySpec, tokenizer: Any, seed: int) -> Any:
    """A freshly initialised float32 model; padded embedding rows are zero."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(build_config(spec, tokenizer)).float()
    with torch.no_grad():
        model.get_input_embeddings().weight[len(tokenizer):].zero_()
    if model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        raise AssertionError("tiny models must tie their word embeddings")
    return model


def load_model(name: str, path: Path | str | None = None, family: TinyFamily = CALCULATOR) -> Any:
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(path or family.asset_dir(name)), attn_implementation=ATTN_IMPLEMENTATION)
    return model.float().eval()


def parameter_count(model: Any) -> int:
    """Distinct parameters (the tied embedding counted once)."""
    return sum(p.numel() for p in model.parameters())


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def masked_logits(logits: torch.Tensor, tokenizer_size: int = TOKENIZER_SIZE) -> torch.Tensor:
    """Padded vocabulary rows can never be predicted."""
    return logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= tokenizer_size, float("-inf"))
