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
        def forward(self, input_ids):
            pos = torch.arange(input_ids.shape[1]).expand_as(input_ids)
            return type("Out", (), {"last_hidden_state": torch.stack([input_ids, pos], -1).float()})

    hidden, tokens = predicting_hidden(Body(), TRAJS, 0, "cpu")
    assert hidden.tolist() == [[6, 1], [8, 3], [1, 0], [2, 1]] and tokens.tolist() == [7, 9, 2, 3]


def test_micro_batches_keep_order_and_cover_everything() -> None:
    assert micro_batches(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert micro_batches([], 4) == []


def test_a_right_padded_batch_gives_each_trajectory_its_own_hidden_states() -> None:
    """No padding mask is passed: under the causal mask a real position never sees the pads after it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    body = Qwen3ForCausalLM(config).eval().model
    long = _trajectory(list(range(3, 14)), [P] * 4 + [M] * 7)
    short = _trajectory([9, 8, 7, 6], [P, P, M, M])
    with torch.no_grad():
        together, tokens = predicting_hidden(body, [long, short, long], pad_id=0, device="cpu")
        alone = [predicting_hidden(body, [t], pad_id=0, device="cpu")[0] for t in (long, short, long)]
    assert tokens.tolist() == long.token_ids[4:] + [7, 6] + long.token_ids[4:]
    torch.testing.assert_close(together, torch.cat(alone), rtol=1e-5, atol=1e-5)
