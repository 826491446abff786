"""The multi-turn episode loop every decoding engine shares.

An `Episode` is one trajectory in progress; `ToolLoop` is the turn bookkeeping
that runs after each model token: it closes a turn at the end-of-turn token,
parses the tool call, runs the tool and queues its response as forced tokens
(provenance `tool`, never a training target), and ends the episode on a final
answer or a budget. `select_next` samples (or picks greedily) and returns the
log-prob under the distribution actually sampled from. Engines only decide how
the forward passes are batched; what a token means is decided here.

A diagnostic can force every first turn to open with a given text ("does the
model finish a tool call it was made to open?"). That prefix is context, not a
model sample: it is fed after the prompt as forced tokens of provenance
`prompt`, so it is never a sampled token and has no sampling log-prob, while
the first turn's text still begins with it, so the judge sees the whole call.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from miniverl.engine.core.artifacts import PROVENANCE_MODEL, PROVENANCE_PROMPT, PROVENANCE_TOOL
from miniverl.engine.tasks.base import Task, TaskItem, ToolCall, ToolResult, Transcript, Verdict
from miniverl.engine.tasks.protocol import END_OF_TURN, parse_tool_calls, render_prompt, tool_responses_text


@dataclass(frozen=True)
class SamplingPolicy:
    greedy: bool
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass(frozen=True)
class Budget:
    max_turns: int
    max_new_tokens_per_turn: int
    max_total_tokens: int


@dataclass
class Episode:
    task: TaskItem
    judge_of: Task
    token_ids: list[int]
    provenance: list[int]
    pending: deque[tuple[int, int]]  # forced (token, provenance) still to feed
    sampling_logprobs: list[float] = field(default_factory=list)
    turn_tokens: list[int] = field(default_factory=list)  # sampled tokens of the open turn
    turn_prefix: list[int] = field(default_factory=list)  # forced tokens that open it (context, not samples)
    turns: list[str] = field(default_factory=list)
    calls: list[tuple[ToolCall, ...]] = field(default_factory=list)  # per turn, checked against the task's tools
    results: list[tuple[ToolResult, ...]] = field(default_factory=list)  # per turn, one per call
    finished: bool = False
    finish_reason: str = ""

    @property
    def tool_results(self) -> list[tuple[str, bool]]:
        """Every tool response fed back (or due when a budget ended the episode), in order."""
        return [(r.text, r.ok) for turn in self.results for r in turn]

    def transcript(self) -> Transcript:
        return Transcript(tuple(self.turns), tuple(self.calls), tuple(self.results), self.finish_reason == "stop")

    def verdict(self) -> Verdict:
        return self.judge_of.judge(self.task, self.transcript())


def select_next(logits_RV: torch.Tensor, policy: SamplingPolicy, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens and their log-probs under the distribution actually sampled from."""
    logits_RV = logits_RV.float()
    if policy.greedy:
        logprobs_RV = torch.log_softmax(logits_RV, dim=-1)
        tokens_R = logits_RV.argmax(dim=-1)
        return tokens_R, logprobs_RV.gather(1, tokens_R[:, None])[:, 0]
    logits_RV = logits_RV / policy.temperature
    if policy.top_p < 1.0:
        # Keep the smallest set of tokens whose probability reaches top_p.
        sorted_logits, order = logits_RV.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= policy.top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits_RV = logits_RV.masked_fill(drop, float("-inf"))
    logprobs_RV = torch.log_softmax(logits_RV, dim=-1)
    tokens_R = torch.multinomial(logprobs_RV.exp(), 1, generator=generator)[:, 0]
    return tokens_R, logprobs_RV.gather(1, tokens_R[:, None])[:, 0]


class ToolLoop:
    """Turn bookkeeping shared by every engine: what happens after a model token."""

    def __init__(self, tokenizer, task: Task, budget: Budget, first_turn_prefix: str = ""):
        self.tokenizer = tokenizer
        self.task = task
        self.budget = budget
        self.end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
        # Tokenized on its own and appended to the prompt's tokens, as segments are everywhere.
        self.prefix_ids = tokenizer(first_turn_prefix, add_special_tokens=False).input_ids if first_turn_prefix else []

    def start(self, item: TaskItem) -> Episode:
        ids = self.tokenizer(render_prompt(self.tokenizer, self.task, item), add_special_tokens=False).input_ids
        forced = deque((t, PROVENANCE_PROMPT) for t in ids + self.prefix_ids)
        return Episode(item, self.task, [], [], forced, turn_prefix=list(self.prefix_ids))

    def feed_forced(self, episode: Episode) -> int:
        token, provenance = episode.pending.popleft()
        episode.token_ids.append(token)
        episode.provenance.append(provenance)
        return token

    def feed_sampled(self, episode: Episode, token: int, logprob: float) -> None:
        episode.token_ids.append(token)
        episode.provenance.append(PROVENANCE_MODEL)
        episode.sampling_logprobs.append(logprob)
        episode.turn_tokens.append(token)
        if token == self.end_of_turn:
            self._end_turn(episode)
        elif len(episode.turn_tokens) >= self.budget.max_new_tokens_per_turn or len(episode.token_ids) >= self.budget.max_total_tokens:
            self._close_turn(episode, run_tools=False)
            self._finish(episode, "length")

    def _close_turn(self, episode: Episode, run_tools: bool) -> str:
        """Record the turn and its checked calls; run them only when the episode goes on."""
        text = self.tokenizer.decode(episode.turn_prefix + episode.turn_tokens, skip_special_tokens=False)
        episode.turns.append(text)
        episode.turn_tokens = []
        episode.turn_prefix = []
        calls = tuple(self.task.check_call(c) for c in parse_tool_calls(text))
        episode.calls.append(calls)
        episode.results.append(tuple(self.task.run_call(c) for c in calls) if run_tools else ())
        return text

    def _end_turn(self, episode: Episode) -> None:
        self._close_turn(episode, run_tools=True)
        results = episode.results[-1]
        if not results:
            self._finish(episode, "stop")
            return
        if len(episode.turns) >= self.budget.max_turns:
            self._finish(episode, "max_turns")
            return
        response = self.tokenizer(tool_responses_text([r.text for r in results]), add_special_tokens=False).input_ids
        if len(episode.token_ids) + len(response) >= self.budget.max_total_tokens:
            self._finish(episode, "length")
            return
        episode.pending.extend((t, PROVENANCE_TOOL) for t in response)

    @staticmethod
    def _finish(episode: Episode, reason: str) -> None:
        episode.finished = True
        episode.finish_reason = reason
