"""Qwen3's tool-use protocol, as text: prompts, tool calls, tool responses.

The multi-turn loop builds a trajectory by appending segments, never by
re-rendering the conversation, so each segment here is exactly what Qwen3's
official chat template renders at that point:

- the prompt: `apply_chat_template(messages, tools=..., add_generation_prompt=True,
  enable_thinking=False)`, which ends with the empty think block
  `<think>\\n\\n</think>\\n\\n` the model then writes after;
- a tool call: `<tool_call>\\n{"name": "...", "arguments": {...}}\\n</tool_call>`,
  several in one turn joined by a newline;
- after the model's `<|im_end|>`: the template's newline, every response of the
  turn in one user message (`\\n<tool_response>\\n...\\n</tool_response>` each),
  and the next generation prompt with its empty think block.

The one place this differs from re-rendering the whole conversation: Qwen3's
template drops an *empty* think block from an assistant turn that is neither
the last message nor has reasoning, so a re-rendered history shows the first
turn as `<|im_start|>assistant\\n<tool_call>...` while the model actually wrote
it after `<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`. Training uses the
form the model sampled from (the think block kept): on-policy log-probs and the
teacher's scores must be computed on the exact context each token was sampled
in, and the re-rendered form would shift every later position.
`tests/unit/tasks/test_qwen3_template.py` checks both facts against the real
template.
"""

from __future__ import annotations

import json
import re
from typing import Any

from miniverl.engine.tasks.base import Task, TaskItem, ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
END_OF_TURN = "<|im_end|>"
EMPTY_THINK = "<think>\n\n</think>\n\n"
NEXT_ASSISTANT = "<|im_start|>assistant\n" + EMPTY_THINK

_BLOCK_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)
_THINK_RE = re.compile(r"<think>.*?</think>", re.S)


def render_prompt(tokenizer: Any, task: Task, item: TaskItem) -> str:
    schemas = task.tool_schemas()
    return tokenizer.apply_chat_template(
        task.messages(item),
        tools=schemas or None,
        add_generation_prompt=True,
        enable_thinking=False,
        tokenize=False,
    )


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One call as the template renders it (`tojson` keeps non-ASCII characters)."""
    return f'{TOOL_CALL_OPEN}\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n{TOOL_CALL_CLOSE}'


def assistant_turn_text(content: str, calls: list[ToolCall] | tuple[ToolCall, ...]) -> str:
    """An assistant turn's text before its `<|im_end|>`: content, then the calls."""
    rendered = [tool_call_text(c.name or "", c.arguments or {}) for c in calls]
    return content + ("\n" if content and rendered else "") + "\n".join(rendered)


def tool_responses_text(results: list[str]) -> str:
    """What follows the model's `<|im_end|>` after a turn that called tools."""
    blocks = "".join(f"\n<tool_response>\n{text}\n</tool_response>" for text in results)
    return f"\n<|im_start|>user{blocks}{END_OF_TURN}\n{NEXT_ASSISTANT}"


def parse_tool_calls(turn_text: str) -> list[ToolCall]:
    """Every `<tool_call>` block of one turn, in order, plus a final one cut before its close tag.

    A usable block is a JSON object with exactly `name` (a string) and
    `arguments` (an object), whitespace around it allowed. Whether the name and
    arguments fit a tool is the task's business (`Task.check_call`).
    """
    calls = [_parse_block(block) for block in _BLOCK_RE.findall(turn_text)]
    tail = turn_text[turn_text.rfind(TOOL_CALL_CLOSE) + len(TOOL_CALL_CLOSE):] if calls else turn_text
    if TOOL_CALL_OPEN in tail:
        calls.append(ToolCall(None, None, "tool call cut off before </tool_call>"))
    return calls


def _parse_block(block: str) -> ToolCall:
    try:
        payload = json.loads(block.strip())
    except json.JSONDecodeError:
        return ToolCall(None, None, "tool call is not valid JSON")
    if not isinstance(payload, dict) or set(payload) != {"name", "arguments"}:
        return ToolCall(None, None, 'tool call must be an object with exactly "name" and "arguments"')
    name, arguments = payload["name"], payload["arguments"]
    if not isinstance(name, str):
        return ToolCall(None, None, '"name" must be a string')
    if not isinstance(arguments, dict):
        return ToolCall(name, None, '"arguments" must be an object')
    return ToolCall(name, arguments)


def strip_thinking(text: str) -> str:
    return _THINK_RE.sub("", text).replace(END_OF_TURN, "")
