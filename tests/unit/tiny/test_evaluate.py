"""Tiny-model evaluation runs the episode loop of rollout and verify, not one of its own.

A scripted model replays fixed assistant turns (greedy picks them), so the
loop's rules can be checked exactly: a turn holding two tool calls gets both
answered in one tool message, as `ToolLoop` answers it when driven by hand; padded
vocabulary rows are never picked; a forced first-turn prefix is context, not a
sampled token, and changes nothing else about the episode.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from support import drive_by_hand  # noqa: E402
from miniverl.engine.core.artifacts import PROVENANCE_MODEL, PROVENANCE_PROMPT, PROVENANCE_TOOL  # noqa: E402
from miniverl.engine.rollout.loop import SamplingPolicy, ToolLoop  # noqa: E402
from miniverl.engine.tasks.base import TaskItem, ToolCall  # noqa: E402
from miniverl.engine.tasks.calculator import CalculatorTask  # noqa: E402
from miniverl.engine.tasks.protocol import END_OF_TURN, TOOL_CALL_OPEN, tool_responses_text  # noqa: E402
from miniverl.engine.tasks.protocol import tool_call_text as _call_text  # noqa: E402
from miniverl.engine.tiny.evaluate import BUDGET, evaluate_greedy, run_tiny_episodes, summarize  # noqa: E402
from miniverl.engine.tiny.models import MODEL_VOCAB_SIZE, TOKENIZER_SIZE, load_tokenizer  # noqa: E402

GREEDY = SamplingPolicy(greedy=True)
CALC = CalculatorTask()
TASK = TaskItem("t0", "What is 2+3?", "5", (ToolCall("calculator", {"expression": "2+3"}),))


def tool_call_text(expression: str) -> str:
    return _call_text("calculator", {"expression": expression})


def final_answer_text(answer: str) -> str:
    return CALC.final_answer_text(answer)


TWO_CALLS = [tool_call_text("2+3") + tool_call_text("4*5") + END_OF_TURN, final_answer_text("5") + END_OF_TURN]
ONE_CALL = [tool_call_text("2+3") + END_OF_TURN, final_answer_text("5") + END_OF_TURN]


class ScriptedModel(torch.nn.Module):
    """Replays `turns`: the next token is the script's token at the current position of the current turn.

    A turn starts after each "</think>\\n\\n" (the end of the prompt and of
    every tool response). Padded vocabulary rows get the highest logit of
    all, so only a vocabulary limit keeps them from being picked.
    """

    def __init__(self, tokenizer, turns: list[str]):
        super().__init__()
        self.turns = [tokenizer(t, add_special_tokens=False).input_ids for t in turns]
        self.opener = tokenizer.convert_tokens_to_ids("</think>")
        self.newlines = len(tokenizer("\n\n", add_special_tokens=False).input_ids)
        self.eos = tokenizer.convert_tokens_to_ids(END_OF_TURN)
        self.history: list[int] = []

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, input_ids, cache=None, use_cache=False, logits_to_keep=0):
        assert input_ids.shape[0] == 1, "the script drives one episode at a time"
        if input_ids.shape[1] > 1:  # a prefill starts a new episode
            self.history = []
        self.history += input_ids[0].tolist()
        opened = [i for i, t in enumerate(self.history) if t == self.opener]
        turn, step = len(opened) - 1, len(self.history) - opened[-1] - 1 - self.newlines
        script = self.turns[min(turn, len(self.turns) - 1)]
        token = script[step] if 0 <= step < len(script) else self.eos
        logits = torch.zeros(1, 1, MODEL_VOCAB_SIZE)
        logits[0, 0, TOKENIZER_SIZE:] = 100.0
        logits[0, 0, token] = 50.0
        return SimpleNamespace(logits=logits)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def by_hand(tokenizer, turns: list[str]):
    """`ToolLoop` driven directly with the script's tokens: the rules rollout and verify follow."""
    return drive_by_hand(ToolLoop(tokenizer, CALC, BUDGET), TASK, turns)


def test_both_tool_calls_of_one_turn_are_answered_in_one_message(tokenizer):
    [episode] = run_tiny_episodes(ScriptedModel(tokenizer, TWO_CALLS), tokenizer, CALC, [TASK], GREEDY)
    reference = by_hand(tokenizer, TWO_CALLS)
    assert episode.token_ids == reference.token_ids and episode.provenance == reference.provenance
    assert episode.turns == reference.turns == TWO_CALLS
    assert episode.tool_results == reference.tool_results == [("5", True), ("20", True)]
    response = tokenizer(tool_responses_text(["5", "20"]), add_special_tokens=False).input_ids
    tool_positions = [i for i, p in enumerate(episode.provenance) if p == PROVENANCE_TOOL]
    assert [episode.token_ids[i] for i in tool_positions] == response
    assert episode.finish_reason == "stop"
    # The answer copies the first result, not the last one: the calculator's judge wants the last.
    verdict = episode.verdict()
    assert verdict["expression_valid"] and not verdict["result_used"] and not verdict.strict_success


def test_padded_rows_are_never_picked(tokenizer):
    [episode] = run_tiny_episodes(ScriptedModel(tokenizer, ONE_CALL), tokenizer, CALC, [TASK], GREEDY)
    assert max(episode.token_ids) < TOKENIZER_SIZE
    assert evaluate_greedy(ScriptedModel(tokenizer, ONE_CALL), tokenizer, CALC, [TASK]) == {
        "n": 1, "strict_success": 1.0, "tool_call_rate": 1.0, "correct": 1.0, "finished": 1.0,
        "first_turn_opens_tool_call": 1.0,
    }


def test_a_forced_prefix_is_context_not_a_sampled_token(tokenizer):
    [sampled] = run_tiny_episodes(ScriptedModel(tokenizer, ONE_CALL), tokenizer, CALC, [TASK], GREEDY)
    [forced] = run_tiny_episodes(ScriptedModel(tokenizer, ONE_CALL), tokenizer, CALC, [TASK], GREEDY, first_turn_prefix=TOOL_CALL_OPEN)
    # The same tokens and turns (the judge sees the whole call) ...
    assert forced.token_ids == sampled.token_ids
    assert forced.turns == sampled.turns == ONE_CALL
    assert forced.tool_results == sampled.tool_results and forced.finish_reason == sampled.finish_reason
    assert summarize([forced]) == summarize([sampled])
    # ... but the opening `<tool_call>` is prompt context: no sampled token, no sampling log-prob.
    first = sampled.provenance.index(PROVENANCE_MODEL)
    assert sampled.token_ids[first] == tokenizer.convert_tokens_to_ids(TOOL_CALL_OPEN)
    assert forced.provenance[:first + 1] == [PROVENANCE_PROMPT] * (first + 1)
    assert forced.provenance[first + 1:] == sampled.provenance[first + 1:]
    assert forced.sampling_logprobs == sampled.sampling_logprobs[1:]
    assert len(forced.sampling_logprobs) == forced.provenance.count(PROVENANCE_MODEL)
