"""A tokenizer with Qwen3's shape, built offline with the `tokenizers` library.

There is no hub here, so the benchmark cannot use Qwen3's own tokenizer. This
one has what memory and sequence length depend on:

- a byte-level BPE with exactly 151,643 regular entries (ids 0..151642): the
  256-symbol byte alphabet, the merges learned from a small corpus (Qwen3's
  tools preamble, calculator traces, this repository's README), and filler
  entries that no merge can reach, up to the size;
- Qwen3's 26 added tokens at Qwen3's ids, 151643..151668 (`<|endoftext|>`,
  `<|im_start|>`, `<|im_end|>`, ..., `<tool_call>` 151657, `</tool_call>`
  151658, ..., `<tool_response>` 151665, `</tool_response>` 151666,
  `<think>` 151667, `</think>` 151668), so len(tokenizer) == 151669 and a
  model vocabulary of 151936 rows has 267 padded rows, as Qwen3's has;
- a chat template that renders tools, tool calls and tool responses the way
  Qwen3's does, with Qwen3's full tools system preamble, so prompts have the
  real structure and about the real length.
"""

from __future__ import annotations

import json
from pathlib import Path

REGULAR_VOCAB = 151_643
# (content, special) in id order from 151643, as in Qwen3's tokenizer_config.json.
ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
]
TOKENIZER_SIZE = REGULAR_VOCAB + len(ADDED_TOKENS)  # 151669

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_EPILOGUE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
)

# Qwen3's template, restricted to what the calculator task renders (no
# reasoning_content bookkeeping); the tools block is Qwen3's text verbatim.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- " + json.dumps(TOOLS_PREAMBLE) + " }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- " + json.dumps(TOOLS_EPILOGUE) + " }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if loop.first and message.content %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n' }}{{- {'name': fn.name, 'arguments': fn.arguments} | tojson }}{{- '\\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def _corpus(readme: Path | None) -> list[str]:
    from miniverl.engine.tasks.calculator import CALCULATOR_TOOL
    from miniverl.engine.tiny.tokenizer import _corpus as calc_traces

    system = "<|im_start|>system\n" + TOOLS_PREAMBLE + "\n" + json.dumps(CALCULATOR_TOOL) + TOOLS_EPILOGUE
    lines = [system] * 50 + calc_traces()
    if readme is not None and readme.is_file():
        lines += [line for line in readme.read_text(encoding="utf-8").splitlines() if line.strip()]
    return lines


def build_tokenizer(out_dir: Path, readme: Path | None = None, merges_vocab: int = 8000) -> int:
    """Write the tokenizer files to `out_dir`; returns len(tokenizer) (151669)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from miniverl.engine.tiny.tokenizer import QWEN_SPLIT_PATTERN

    def pre_tokenizer():
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=merges_vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    learner.train_from_iterator(_corpus(readme), trainer=trainer)
    learned = json.loads(learner.to_str())["model"]
    vocab: dict[str, int] = dict(learned["vocab"])
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    # Filler entries: printable ASCII (so they decode), but "<" never merges
    # with letters under Qwen's pre-tokenizer, so no input ever produces them.
    index = 0
    while len(vocab) < REGULAR_VOCAB:
        name = f"<fill{index}>"
        index += 1
        if name not in vocab:
            vocab[name] = len(vocab)
    assert sorted(vocab.values()) == list(range(REGULAR_VOCAB))

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    for content, special in ADDED_TOKENS:  # one at a time: ids are assigned in call order
        token = AddedToken(content, special=special, normalized=False)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([token])
    for expected, (content, _) in enumerate(ADDED_TOKENS, start=REGULAR_VOCAB):
        assert tokenizer.token_to_id(content) == expected, (content, tokenizer.token_to_id(content), expected)

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 40960
    assert len(fast) == TOKENIZER_SIZE, len(fast)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return len(fast)
