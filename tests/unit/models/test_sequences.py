"""Which hidden states predict which tokens: model tokens only, each from the position before it."""

from __future__ import annotations

import torch

from miniverl.engine.core.artifacts import PROVENANCE_MODEL as M, PROVENANCE_PROMPT as P, PROVENANCE_TOOL as T, Trajectory
from miniverl.engine.models.sequences import batch_tensors, micro_batches, predicting_hidden, target_index


def _trajectory(ids: list[int], provenance: list[int]) -> Trajectory:
    n = sum(p == M for p in provenance)
    return Trajectory("t", "q", "2", ids, provenance, [0.0] * n, [], [], [], "stop", False, False, False)


TRAJS = [_trajectory([5, 6, 7, 8, 9], [P, P, M, T, M]), _trajectory([1, 2, 3], [P, M, M])]


def test_targets_are_model_tokens_predicted_from_the_previous_position() -> None:
    rows, positions, tokens = target_index(TRAJS)
    assert rows.tolist() == [0, 0, 1, 1]
    assert positions.tolist() == [1, 3, 0, 1]  # never a prompt or tool token as a target
    assert tokens.tolist() == [7, 9, 2, 3]


def test_padding_is_masked_and_gathering_matches_a_loop() -> None:
    ids, mask = batch_tensors(TRAJS, pad_id=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 0, 0]] and mask.tolist() == [[1] * 5, [1, 1, 1, 0, 0]]

    class Body(torch.nn.Module):  # hidden state = (token id, position), enough to see what is gathered
        def forward(self, input_ids, attention_mask):
            pos = torch.arange(input_ids.shape[1]).expand_as(input_ids)
            return type("Out", (), {"last_hidden_state": torch.stack([input_ids, pos], -1).float()})

    hidden, tokens = predicting_hidden(Body(), TRAJS, 0, "cpu")
    assert hidden.tolist() == [[6, 1], [8, 3], [1, 0], [2, 1]] and tokens.tolist() == [7, 9, 2, 3]


def test_micro_batches_keep_order_and_cover_everything() -> None:
    assert micro_batches(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert micro_batches([], 4) == []
