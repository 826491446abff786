"""PinnedWeights: parked parameters keep their identity, ties and values; trainable ones never move.

On the CPU the moves are plain copies (pinning needs CUDA); the GPU tests
(tests/gpu/test_gpu.py, swap) check that parking frees device memory.
"""

from __future__ import annotations

import torch

from miniverl.engine.models.offload import PinnedWeights


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight  # one Parameter, as in Qwen3's tied embedding
        self.adapter = torch.nn.Parameter(torch.ones(4))  # trainable: stays where it is
        for p in (self.embed.weight, self.body.weight, self.body.bias):
            p.requires_grad_(False)


def test_release_and_restore_keep_parameters_ties_and_values() -> None:
    torch.manual_seed(0)
    model = Tied()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = {n: p for n, p in model.named_parameters()}
    parked = PinnedWeights(model, "cpu")
    storage = model.body.weight.data_ptr()
    parked.release()
    assert parked.released and model.body.weight.data_ptr() != storage  # moved to its host copy
    assert model.adapter.data_ptr() == params["adapter"].data_ptr()
    parked.restore()
    assert not parked.released
    assert {n: p for n, p in model.named_parameters()} == params  # the same Parameter objects
    assert model.head.weight is model.embed.weight
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_a_kept_head_stays_and_can_come_back_alone() -> None:
    model = Tied()
    parked = PinnedWeights(model, "cpu")
    head = model.head.weight
    parked.release(keep=(head,))
    assert parked.resident_bytes() == head.numel() * head.element_size()
    parked.release()  # now the head too
    assert parked.resident_bytes() == 0
    parked.restore(only=(head,))
    assert parked.resident_bytes() == head.numel() * head.element_size() and parked.released
    parked.restore()
    assert parked.resident_bytes() == sum(p.numel() * p.element_size() for p in
                                          (model.embed.weight, model.body.weight, model.body.bias))


def test_the_host_copy_is_made_once() -> None:
    model = Tied()
    parked = PinnedWeights(model, "cpu")
    parked.release()
    first = model.body.weight.data_ptr()
    parked.restore()
    parked.release()
    assert model.body.weight.data_ptr() == first  # the same host copy, not a new one each time
