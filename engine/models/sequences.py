"""From trajectories to the hidden states that predict their model tokens.

Position p's token is predicted by the hidden state at p-1, so for every
model-generated token we gather hidden[p-1]. Prompt and tool-response tokens
are context only: they are never gathered, so they are never targets.
"""

from __future__ import annotations

import torch

from miniverl.engine.core.artifacts import Trajectory


def batch_tensors(trajectories: list[Trajectory], pad_id: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and attention mask, (B, L)."""
    length = max(len(t.token_ids) for t in trajectories)
    ids_BL = torch.full((len(trajectories), length), pad_id, dtype=torch.long)
    mask_BL = torch.zeros((len(trajectories), length), dtype=torch.long)
    for row, traj in enumerate(trajectories):
        ids_BL[row, : len(traj.token_ids)] = torch.tensor(traj.token_ids)
        mask_BL[row, : len(traj.token_ids)] = 1
    return ids_BL.to(device), mask_BL.to(device)


def target_index(trajectories: list[Trajectory]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, predicting position, target token) for each model token, in trajectory order."""
    rows, positions, tokens = [], [], []
    for row, traj in enumerate(trajectories):
        for p in traj.model_positions:
            rows.append(row)
            positions.append(p - 1)
            tokens.append(traj.token_ids[p])
    return torch.tensor(rows, dtype=torch.long), torch.tensor(positions, dtype=torch.long), torch.tensor(tokens, dtype=torch.long)


def predicting_hidden(body: torch.nn.Module, trajectories: list[Trajectory], pad_id: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states (after the last norm) at the predicting positions, (N, H), and targets (N,)."""
    ids_BL, _ = batch_tensors(trajectories, pad_id, device)
    # No attention mask: the rows are right-padded, so under the causal mask no
    # real position ever sees a pad, and positions count from 0 either way. A
    # padding mask would only make SDPA build a [B, heads, L, L] mask and leave
    # its fused kernels for the math path (0.7 GiB at 6 x 704 tokens, Qwen3-1.7B).
    hidden_BLH = body(input_ids=ids_BL).last_hidden_state
    rows, positions, tokens = target_index(trajectories)
    return hidden_BLH[rows.to(device), positions.to(device)], tokens.to(device)


def micro_batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]
