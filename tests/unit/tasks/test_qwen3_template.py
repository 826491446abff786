"""Every task's prompt and multi-turn continuation against Qwen3's real chat template (tests/fixtures/qwen3/).

The rollout loop never re-renders a conversation. It appends segments
(`tasks/protocol.py`): the prompt, the model's sampled turn, the tool responses
with the next generation prompt, the next sampled turn. These tests drive
`ToolLoop` by hand with scripted model turns and compare the decoded
trajectory with what the real template renders for the same conversation.
They also feed the parser what Qwen3 emits, and what a token budget leaves of it.

The one documented difference: when the template re-renders a history, it
drops the empty `<think>\\n\\n</think>\\n\\n` from every assistant turn that
is not the last message and has no reasoning. The loop keeps the block,
because the model sampled that turn right after it (the generation prompt
with `enable_thinking=False` ends with it), and training must score each
token in the context it was sampled in.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from miniverl.engine.rollout.loop import Budget, Episode, ToolLoop
from miniverl.engine.tasks import protocol
from miniverl.engine.tasks.base import Task, TaskItem, ToolCall
from miniverl.engine.tasks.calculator import CalculatorTask
from miniverl.engine.tasks.jsonl import JsonlTask
from miniverl.engine.tasks.sql import SqlTask
from qwen3_fixture import qwen3_tokenizer

ASSISTANT = "<|im_start|>assistant\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"
BUDGET = Budget(max_turns=4, max_new_tokens_per_turn=256, max_total_tokens=4096)

# Qwen3's tools system prompt, copied from the template in tokenizer_config.json (an independent reading of it).
TOOLS_HEAD = ("<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
              "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_TAIL = ('\n</tools>\n\nFor each function call, return a json object with function name and arguments within '
              '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
              '<args-json-object>}\n</tool_call><|im_end|>\n')

TOOLS_MODULE = '''
def multiply(a: int, b: int) -> int:
    """Multiply two integers (a × b).

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def letters(word: str) -> str:
    """Zählt die Buchstaben eines Wortes, z. B. „café“.

    Args:
        word: das Wort
    """
    return f"„{word}“ hat {len(word)} Buchstaben"
'''
JSONL_ITEMS = [
    {"id": "mul", "prompt": "Wie viel ist 3 × 4?", "answer": "12", "split": "train"},
    {"id": "cafe", "prompt": "Wie viele Buchstaben hat „café“?", "answer": "4", "split": "train"},
    {"id": "both", "prompt": "Was ist 3 × 4, und wie lang ist „café“?", "answer": "12 und 4", "split": "train"},
    {"id": "quote", "prompt": "Wie lang ist <a & 'b'>?", "answer": "10", "split": "train"},
    {"id": "held", "prompt": "Wie viel ist 5 × 6?", "answer": "30", "split": "heldout"},
]
JSONL_CALLS = {  # the JSONL task has no oracle: the calls a model would make, one tuple per tool turn
    "mul": ((ToolCall("multiply", {"a": 3, "b": 4}),),),
    "cafe": ((ToolCall("letters", {"word": "café"}),),),
    "both": ((ToolCall("multiply", {"a": 3, "b": 4}), ToolCall("letters", {"word": "café"})),),
    "quote": ((ToolCall("letters", {"word": "<a & 'b'>"}),), (ToolCall("multiply", {"a": 2, "b": 5}),)),
}


@pytest.fixture(scope="module")
def tok():
    return qwen3_tokenizer()


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> dict[str, Task]:
    root = tmp_path_factory.mktemp("qwen3_jsonl")
    (root / "tools.py").write_text(TOOLS_MODULE, encoding="utf-8")
    (root / "items.jsonl").write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in JSONL_ITEMS),
                                      encoding="utf-8")
    built = {"calculator": CalculatorTask(), "sql": SqlTask(),
             "jsonl": JsonlTask(root / "items.jsonl", tools=root / "tools.py")}
    yield built
    for task in built.values():
        task.close()


def cases(task: Task) -> list[tuple[TaskItem, tuple[tuple[ToolCall, ...], ...]]]:
    """A few items of `task`, each with the calls of every tool turn (the oracle's where there is one)."""
    if isinstance(task, JsonlTask):
        items = task.items("train", 4, seed=0)
        return [(item, JSONL_CALLS[item.task_id]) for item in items]
    return [(item, (item.reference_calls,)) for item in task.items("train", 3, seed=0)]


def drive(tok, task: Task, item: TaskItem, turns: list[str], budget: Budget = BUDGET) -> tuple[Episode, list[int]]:
    """ToolLoop by hand: forced tokens as they come, each scripted turn's tokens as if sampled.

    Returns the episode and, per turn, how many tokens preceded it.
    """
    loop = ToolLoop(tok, task, budget)
    episode = loop.start(item)
    starts = []
    for turn in turns:
        while episode.pending:
            loop.feed_forced(episode)
        starts.append(len(episode.token_ids))
        for token in tok(turn, add_special_tokens=False).input_ids:
            if episode.finished:
                break
            loop.feed_sampled(episode, token, 0.0)
    return episode, starts


def scripted_turns(task: Task, item: TaskItem, rounds, content: str = "") -> list[str]:
    """What the model writes: each tool turn (calls after an optional text), then the final answer."""
    return ([protocol.assistant_turn_text(content, calls) + "<|im_end|>" for calls in rounds]
            + [task.final_answer_text(item.answer) + "<|im_end|>"])


def conversation(task: Task, item: TaskItem, rounds, episode: Episode, content: str = "") -> list[dict]:
    """The same conversation as chat messages (the tool contents are what the tools returned in the episode)."""
    messages = [{"role": "user", "content": item.question}]
    for calls, results in zip(rounds, episode.results):
        messages.append({"role": "assistant", "content": content, "tool_calls": [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]})
        messages += [{"role": "tool", "content": r.text} for r in results]
    messages.append({"role": "assistant", "content": task.final_answer_text(item.answer)})
    return messages


def keep_empty_think(rendered: str, earlier_turns: int) -> str:
    """The template's re-rendering with the empty think block put back into the first `earlier_turns` assistant turns."""
    turns = rendered.split(ASSISTANT)[1:]
    assert len(turns) == earlier_turns + 1
    assert not any(turn.startswith("<think>") for turn in turns[:-1])  # dropped from every earlier turn
    return rendered.replace(ASSISTANT, ASSISTANT + EMPTY_THINK, earlier_turns)


def render(tok, task: Task, messages: list[dict], generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tools=task.tool_schemas(), add_generation_prompt=generation_prompt,
                                   enable_thinking=False, tokenize=False)


# ----------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("name", ["calculator", "sql", "jsonl"])
def test_prompt_is_the_template_rendering(tok, tasks, name):
    task = tasks[name]
    schemas = task.tool_schemas()
    for item, _ in cases(task):
        prompt = protocol.render_prompt(tok, task, item)
        assert prompt == render(tok, task, [{"role": "user", "content": item.question}], generation_prompt=True)
        # The template read by hand: the tools block, one tojson line per tool (non-ASCII kept), the user turn,
        # and the generation prompt with thinking switched off.
        tool_lines = "".join("\n" + json.dumps(schema, ensure_ascii=False) for schema in schemas)
        assert prompt == (TOOLS_HEAD + tool_lines + TOOLS_TAIL + f"<|im_start|>user\n{item.question}<|im_end|>\n"
                          + ASSISTANT + EMPTY_THINK)


def test_prompt_keeps_non_ascii_as_tojson_does(tok, tasks):
    task = tasks["jsonl"]
    item = next(i for i, _ in cases(task) if i.task_id == "mul")
    prompt = protocol.render_prompt(tok, task, item)
    assert "<|im_start|>user\nWie viel ist 3 × 4?<|im_end|>" in prompt
    assert '"description": "Zählt die Buchstaben eines Wortes, z. B. „café“."' in prompt
    assert "\\u00" not in prompt and "\\u201" not in prompt


# ----------------------------------------------------------------------------- the multi-turn continuation


@pytest.mark.parametrize("name", ["calculator", "sql", "jsonl"])
def test_continuation_is_the_template_rendering_with_the_think_block_kept(tok, tasks, name):
    """loop text == re-rendered conversation with `<think>\\n\\n</think>\\n\\n` put back after each earlier
    `<|im_start|>assistant\\n`; nothing else differs. The template also writes a newline after the last
    `<|im_end|>`, where the loop stops (the model's end-of-turn token ends the episode)."""
    task = tasks[name]
    for item, rounds in cases(task):
        episode, starts = drive(tok, task, item, scripted_turns(task, item, rounds))
        assert episode.finish_reason == "stop" and len(episode.turns) == len(rounds) + 1
        assert all(r.ok for turn in episode.results for r in turn)
        loop_text = tok.decode(episode.token_ids, skip_special_tokens=False)
        messages = conversation(task, item, rounds, episode)

        rendered = render(tok, task, messages, generation_prompt=False)
        assert rendered.count(ASSISTANT + EMPTY_THINK) == 1  # only the last turn keeps its empty think block
        assert loop_text + "\n" == keep_empty_think(rendered, len(rounds))

        # Up to the last tool responses and the next generation prompt: the prompt the final turn was sampled from.
        context = tok.decode(episode.token_ids[:starts[-1]], skip_special_tokens=False)
        history = render(tok, task, messages[:-1], generation_prompt=True)
        assert context == keep_empty_think(history, len(rounds))

        # Token level: the loop tokenizes segment by segment; the whole text tokenizes to the same ids here,
        # because every boundary is next to a special or added token.
        assert tok(loop_text, add_special_tokens=False).input_ids == episode.token_ids


def test_one_calculator_trajectory_written_out(tok, tasks):
    """The whole continuation of one calculator item, spelled out from the template by hand."""
    task = tasks["calculator"]
    item = TaskItem("t", "What is 12*3?", "36", (ToolCall("calculator", {"expression": "12*3"}),))
    episode, _ = drive(tok, task, item, scripted_turns(task, item, (item.reference_calls,)))
    prompt = protocol.render_prompt(tok, task, item)
    assert tok.decode(episode.token_ids, skip_special_tokens=False) == prompt + (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*3"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n36\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer is 36.<|im_end|>")


def test_text_before_the_calls_renders_as_the_template_does(tok, tasks):
    task = tasks["calculator"]
    item = TaskItem("t", "What is 40+2?", "42", (ToolCall("calculator", {"expression": "40+2"}),))
    rounds = (item.reference_calls,)
    episode, _ = drive(tok, task, item, scripted_turns(task, item, rounds, content="Let me compute that."))
    rendered = render(tok, task, conversation(task, item, rounds, episode, content="Let me compute that."), False)
    loop_text = tok.decode(episode.token_ids, skip_special_tokens=False)
    assert loop_text + "\n" == keep_empty_think(rendered, 1)
    assert "Let me compute that.\n<tool_call>\n" in loop_text


def test_two_calls_in_one_turn_are_one_user_message_of_responses(tok, tasks):
    """Consecutive tool messages: the template opens one user turn, writes each response, closes it once."""
    task = tasks["calculator"]
    calls = (ToolCall("calculator", {"expression": "12*3"}), ToolCall("calculator", {"expression": "40+2"}))
    item = TaskItem("t", "What is 12*3 and 40+2?", "36 and 42", calls)
    episode, starts = drive(tok, task, item, scripted_turns(task, item, (calls,)))
    assert [r.text for r in episode.results[0]] == ["36", "42"]
    messages = conversation(task, item, (calls,), episode)
    history = render(tok, task, messages[:-1], generation_prompt=True)
    expected = protocol.tool_responses_text(["36", "42"])
    assert history.endswith("</tool_call><|im_end|>" + expected)
    assert expected == ("\n<|im_start|>user\n<tool_response>\n36\n</tool_response>\n<tool_response>\n42\n"
                        "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    context = tok.decode(episode.token_ids[:starts[-1]], skip_special_tokens=False)
    assert context == keep_empty_think(history, 1)


@pytest.mark.parametrize("arguments", [
    {"word": "café"},
    {"query": "SELECT name FROM t WHERE price < 10 AND note = 'a & b' -- \"quoted\""},
    {"filter": {"city": "Zürich", "tags": ["a", "ß"], "range": {"min": 1.5, "max": None}}, "dry_run": False},
    {"emoji": "🙂", "escapes": "tab\there\nnewline\\backslash", "n": -3, "x": 1e-07},
    {},
])
def test_a_tool_call_renders_as_the_template_renders_it(tok, arguments):
    """`tool_call_text` against the template's own rendering of the call (`tojson`: non-ASCII kept, no HTML escaping)."""
    calls = (ToolCall("lookup", arguments), ToolCall("other", {"k": "v"}))
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}]
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert rendered.endswith(ASSISTANT + EMPTY_THINK + protocol.assistant_turn_text("", calls) + "<|im_end|>\n")
    assert protocol.parse_tool_calls(protocol.assistant_turn_text("", calls)) == list(calls)


def test_a_sampled_turn_that_starts_with_a_newline_does_not_retokenize_to_the_same_ids(tok, tasks):
    """Why training keeps the token ids the loop recorded instead of retokenizing the text: a turn that begins
    with a newline right after the prompt's `\\n\\n` decodes to the same text, but tokenizing that text as a whole
    merges the newlines into other tokens."""
    task = tasks["calculator"]
    item = TaskItem("t", "What is 1+1?", "2", ())
    episode, _ = drive(tok, task, item, ["\nThe answer is 2.<|im_end|>"])
    text = tok.decode(episode.token_ids, skip_special_tokens=False)
    assert text.endswith("</think>\n\n\nThe answer is 2.<|im_end|>")
    assert tok(text, add_special_tokens=False).input_ids != episode.token_ids


# ----------------------------------------------------------------------------- the tool-call parser


CALC = '{"name": "calculator", "arguments": {"expression": "12*3"}}'
SQL = '{"name": "sql", "arguments": {"query": "SELECT 1"}}'
GOOD = [ToolCall("calculator", {"expression": "12*3"}), ToolCall("sql", {"query": "SELECT 1"})]


@pytest.mark.parametrize("text", [
    f"<tool_call>\n{CALC}\n</tool_call>\n<tool_call>\n{SQL}\n</tool_call>",  # what the template writes
    f"<tool_call>\n{CALC}\n</tool_call><tool_call>\n{SQL}\n</tool_call>",  # no newline between the blocks
    f"<tool_call>{CALC}</tool_call>\n\n<tool_call>{SQL}</tool_call>",  # no newlines inside
    f"<tool_call>   {CALC}  \n\n</tool_call> <tool_call>\t\n{SQL}\n\t</tool_call>",  # extra spaces, tabs
    f"<tool_call>\r\n{CALC}\r\n</tool_call>\r\n<tool_call>\r\n{SQL}\r\n</tool_call>",  # CRLF
    f"I will use two tools.\n<tool_call>\n{CALC}\n</tool_call>\nand then\n<tool_call>\n{SQL}\n</tool_call>\n",
    f"<think>\nTwo lookups are needed.\n</think>\n\n<tool_call>\n{CALC}\n</tool_call>\n<tool_call>\n{SQL}\n</tool_call>",
    f'<tool_call>\n{{"name": "calculator",\n  "arguments": {{"expression": "12*3"}}}}\n</tool_call>'
    f'<tool_call>\n{{ "name" : "sql" , "arguments" : {{ "query" : "SELECT 1" }} }}\n</tool_call><|im_end|>',
])
def test_parser_reads_several_calls_in_any_whitespace(text):
    assert protocol.parse_tool_calls(text) == GOOD


def test_parser_keeps_nested_arguments():
    arguments = {"filter": {"city": "Zürich", "tags": ["a", {"b": [1, 2.5, None, True]}]}, "limit": 3}
    text = protocol.tool_call_text("search", arguments)
    assert protocol.parse_tool_calls(text) == [ToolCall("search", arguments)]


def test_a_call_cut_by_the_token_budget_is_an_error():
    cut = '<tool_call>\n{"name": "calculator", "arguments": {"expre'
    [call] = protocol.parse_tool_calls(cut)
    assert call.error is not None and "cut off" in call.error
    first, second = protocol.parse_tool_calls(f"<tool_call>\n{CALC}\n</tool_call>\n" + cut)
    assert first == GOOD[0] and second.error is not None and "cut off" in second.error
    [only] = protocol.parse_tool_calls("<tool_call>")
    assert only.error is not None


def test_the_loop_records_a_cut_call_and_runs_nothing(tok, tasks):
    """The token budget ends a turn inside its second call: one good call, one error, no tool run."""
    task = tasks["calculator"]
    calls = (ToolCall("calculator", {"expression": "12*3"}), ToolCall("calculator", {"expression": "40+2"}))
    turn = protocol.assistant_turn_text("", calls) + "<|im_end|>"
    ids = tok(turn, add_special_tokens=False).input_ids
    cut_at = ids.index(tok.convert_tokens_to_ids("<tool_call>"), 1) + 4  # a few tokens into the second call
    budget = Budget(max_turns=4, max_new_tokens_per_turn=cut_at, max_total_tokens=4096)
    episode, _ = drive(tok, task, TaskItem("t", "q", "36", calls), [turn], budget)
    assert episode.finish_reason == "length" and episode.results == [()]
    first, second = episode.calls[0]
    assert first == calls[0] and second.error is not None and "cut off" in second.error


@pytest.mark.parametrize("block,why", [
    ('{"name": "calculator", "arguments": {"expression": "1+1"', "not valid JSON"),
    ('["calculator", {"expression": "1+1"}]', 'exactly "name" and "arguments"'),
    ('{"name": "calculator"}', 'exactly "name" and "arguments"'),
    ('{"name": "calculator", "arguments": {}, "id": "call_0"}', 'exactly "name" and "arguments"'),
    ('{"name": 7, "arguments": {}}', '"name" must be a string'),
    ('{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}', '"arguments" must be an object'),
    ("", "not valid JSON"),
])
def test_json_of_the_wrong_shape_is_an_error(block, why):
    [call] = protocol.parse_tool_calls(f"<tool_call>\n{block}\n</tool_call>")
    assert call.error is not None and why in call.error


def _check_prefix(prefix: str) -> None:
    """Every closed block of a valid two-call turn parses; an open one after the last close is one error."""
    calls = protocol.parse_tool_calls(prefix)
    closed = prefix.count(protocol.TOOL_CALL_CLOSE)
    assert [c for c in calls if c.well_formed] == GOOD[:closed]
    tail = prefix[prefix.rfind(protocol.TOOL_CALL_CLOSE) + len(protocol.TOOL_CALL_CLOSE):] if closed else prefix
    assert len(calls) == closed + (protocol.TOOL_CALL_OPEN in tail)


def test_every_truncation_of_a_two_call_turn_parses_without_raising(tok):
    turn = f"Zwei Aufrufe für café:\n<tool_call>\n{CALC}\n</tool_call>\n<tool_call>\n{SQL}\n</tool_call><|im_end|>"
    for end in range(len(turn) + 1):  # cut anywhere in the text
        _check_prefix(turn[:end])
    ids = tok(turn, add_special_tokens=False).input_ids
    for end in range(len(ids) + 1):  # cut where a token budget cuts: after a token (é may decode half-way)
        _check_prefix(tok.decode(ids[:end], skip_special_tokens=False))
    rng = random.Random(0)
    for _ in range(300):  # arbitrary spans removed: never raises, and every result is a ToolCall
        a, b = sorted(rng.sample(range(len(turn) + 1), 2))
        assert all(isinstance(c, ToolCall) for c in protocol.parse_tool_calls(turn[:a] + turn[b:]))


def test_fixture_is_the_real_tokenizer(tok):
    assert len(tok) == 151_669 and type(tok).__name__ == "Qwen2Tokenizer"
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                                                     "<tool_response>", "</tool_response>", "<think>", "</think>")}
    assert list(ids.values()) == [151644, 151645, 151657, 151658, 151665, 151666, 151667, 151668]
    assert Path(tok.name_or_path).name == "qwen3"
