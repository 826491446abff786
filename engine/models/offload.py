"""A frozen model's weights parked in pinned host memory while no stage uses them.

The parameters' host copies are made once (page-locking ~3 GiB takes seconds)
and never change, since these weights are frozen: releasing is a pointer swap
that frees the device blocks without a copy, and restoring is one pinned
host-to-device copy per tensor (~55 GB/s on an H200, about half on a PCIe 4.0
card). Parameters keep their identity, so modules, hooks and the LM-head tie
(one Parameter shared by the embedding and the head) survive the moves.
Buffers (rotary tables) and trainable parameters (a LoRA adapter) stay put.
"""

from __future__ import annotations

import torch


class PinnedWeights:
    def __init__(self, model: torch.nn.Module, device: str):
        self.device = device
        self._cuda = device.startswith("cuda")  # pinning needs CUDA; on the CPU the moves only exercise the logic
        seen: set[int] = set()
        self._params: list[torch.nn.Parameter] = []
        for param in model.parameters():  # a tied parameter is listed once
            if not param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                self._params.append(param)
        self._host: dict[int, torch.Tensor] = {}
        self._released: set[int] = set()

    def release(self, keep: tuple[torch.Tensor, ...] = ()) -> None:
        """Every frozen parameter but `keep` leaves the device (its pinned copy made on first release)."""
        kept = {id(t) for t in keep}
        for param in self._params:
            key = id(param)
            if key in kept or key in self._released:
                continue
            if key not in self._host:
                pinned = torch.empty(param.shape, dtype=param.dtype, pin_memory=self._cuda)
                self._host[key] = pinned.copy_(param.data)
            param.data = self._host[key]
            self._released.add(key)
        if self._cuda:
            torch.cuda.empty_cache()  # the driver, and the next stage's peak, get the blocks back

    def restore(self, only: tuple[torch.Tensor, ...] | None = None) -> None:
        """The released parameters (or just `only`) back on the device."""
        wanted = None if only is None else {id(t) for t in only}
        moved = False
        for param in self._params:
            key = id(param)
            if key in self._released and (wanted is None or key in wanted):
                param.data = self._host[key].to(self.device, non_blocking=True)
                self._released.discard(key)
                moved = True
        if moved and self._cuda:
            torch.cuda.current_stream().synchronize()  # the pinned source must not be reused mid-copy

    @property
    def released(self) -> bool:
        return bool(self._released)

    def resident_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._params if id(p) not in self._released)
