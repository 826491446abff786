"""RNG streams derived from (seed, cycle, stage), so a resumed stage draws what it drew before."""

from __future__ import annotations

import hashlib

import torch


def derive_seed(seed: int, cycle: int, stage: str) -> int:
    digest = hashlib.sha256(f"{seed}/{cycle}/{stage}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator(seed: int, cycle: int, stage: str, device: str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(seed, cycle, stage))
    return gen
