"""The embedded tiny tokenizer: byte-level BPE with Qwen3's special tokens.

Built with the `tokenizers` library from a deterministic corpus of calculator
traces, so common words ("calculator", "expression") become single tokens and
sequences stay short on a CPU. Digits are split one per token, as Qwen3 does.
The chat template renders tools, tool calls and tool responses the way Qwen3's
template does (the tools block is shortened), so `tasks.calculator` drives the
tiny and the real models through one code path.
"""

from __future__ import annotations

from pathlib import Path

from miniverl.engine.tasks.base import Task, TaskItem
from miniverl.engine.tasks.protocol import END_OF_TURN, assistant_turn_text, tool_responses_text

# Qwen2/3's pre-tokenizer pattern: digits stand alone, words keep one leading
# non-letter, whitespace runs are grouped.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
MODEL_VOCAB_MULTIPLE = 64  # the model's embedding is padded past the tokenizer, as Qwen3's is

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool.function.name }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}"
    "{%- set fn = call.function if call.function is defined else call %}"
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


def corpus(task: Task, error_example: str, count: int = 3000) -> list[str]:
    """Rendered traces (protocol and direct answers) the BPE merges are learned on."""
    header = "<|im_start|>system\n# Tools\n<tools>\n" + "\n".join(t.name for t in task.tools) + "\n</tools><|im_end|>\n"
    lines = []
    for item in training_items(task, count, seed=0):
        prompt = f"{header}<|im_start|>user\n{item.question}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        results = [task.run_call(call).text for call in item.reference_calls]
        lines.append(prompt + assistant_turn_text("", item.reference_calls) + END_OF_TURN)
        lines.append(tool_responses_text(results) + task.final_answer_text(item.answer))
        lines.append(task.final_answer_text(item.answer) + " " + error_example)
    return lines


def training_items(task: Task, count: int, seed: int) -> list[TaskItem]:
    """`count` train items: distinct while the split has enough, then the split again, reshuffled."""
    available = task.capacity("train")
    items: list[TaskItem] = []
    draw = 0
    while len(items) < count:
        take = min(available, count - len(items))
        items += task.items("train", take, seed if draw == 0 else seed * 1000 + draw)
        draw += 1
    return items


def build_tokenizer(out_dir: Path, task: Task, error_example: str, vocab_size: int) -> None:
    """Train the BPE deterministically on the task's traces and save it as a transformers tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(task, error_example), trainer=trainer)
    tokenizer.add_tokens(ADDED_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1024
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))


def padded_vocab_size(tokenizer_size: int) -> int:
    """Round up past the tokenizer so there is always at least one padded row."""
    return -(-(tokenizer_size + 1) // MODEL_VOCAB_MULTIPLE) * MODEL_VOCAB_MULTIPLE
