"""Tiny and degenerate attention shapes: probe's extra memory stays within ``memory_budget``.

Regression (issue 12, item 1): the causal diagonal-block mask was sized from the chunk length
planned for ``B·H·S``, not from the rows there are: SDPA with ``q`` of shape (1, 1, 8, 8) peaked
at 8.4 GiB and (1, 2, 1, 8) asked for 64 GiB inside the model's forward. Here every shape with
``L, S`` in 0..9 and ``B·H`` in 1..4, causal or not, with and without gradients, runs bare and
probed under :class:`tests.faults.memory.PeakMemory`; the probed peak may exceed the bare one by
at most the probe's ``memory_budget``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe
from tests.faults.memory import PeakMemory

BUDGET = 64 * 2**10  # a small budget, so that the bound is tight for these shapes
BATCH_HEADS = ((1, 1), (2, 1), (1, 3), (2, 2))  # B·H = 1, 2, 3, 4


class Attend(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def _peak(model: nn.Module, q, k, v, grads: bool) -> PeakMemory:
    with PeakMemory() as mem:
        with torch.set_grad_enabled(grads):
            out = model(q, k, v)
            if grads:
                out.sum().backward()
    assert not mem.refused, mem.refused
    return mem


@pytest.fixture
def one_thread():
    """Tiny ops on a busy 2-core machine wait on each other's threads: one thread is 5x faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_peak_memory_meter_sees_cpu_allocations(one_thread):
    with PeakMemory() as mem:
        a = torch.empty(2**20)  # 4 MiB
        b = a + 1  # 8 MiB live
        del a, b
        c = torch.ones(10)
    assert mem.peak == 8 * 2**20 and mem.current == 40
    with pytest.raises(MemoryError), PeakMemory(cap=2**20) as mem:
        torch.ones(2**19)  # 2 MiB > cap: refused before allocating
    assert mem.refused
    del c


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("grads", [False, True], ids=["nograd", "grad"])
def test_tiny_shapes_stay_within_memory_budget(causal: bool, grads: bool, one_thread):
    """Every (L, S) in 0..9 x 0..9; B·H cycles through 1..4 with an offset per case, so that
    over the four cases every (L, S) meets every B·H."""
    offset = 2 * causal + grads
    by_heads = {}
    for length, keys in itertools.product(range(10), range(10)):
        by_heads.setdefault(BATCH_HEADS[(length + keys + offset) % 4], []).append((length, keys))
    worst, measured = (0, None), 0
    for (batch, heads), shapes in by_heads.items():
        bare, watched = Attend(causal), Attend(causal)
        with probe.watch(watched, every=1, memory_budget=BUDGET) as p:
            for length, keys in shapes:
                q = torch.randn(batch, heads, length, 8, requires_grad=grads)
                k = torch.randn(batch, heads, keys, 8, requires_grad=grads)
                v = torch.randn(batch, heads, keys, 8, requires_grad=grads)
                expected = _peak(bare, q, k, v, grads).peak
                extra = _peak(watched, q, k, v, grads).peak - expected
                if extra > worst[0]:
                    worst = (extra, (batch, heads, length, keys))
            measured += len(p.summary().sites)
    assert worst[0] <= BUDGET, f"extra peak {worst[0]} bytes at (B, H, L, S) = {worst[1]}"
    assert measured == len(by_heads)  # the non-empty shapes were measured


@pytest.mark.parametrize("shape", [(1, 1, 8, 8), (1, 2, 1, 8), (1, 1, 1, 1)])
def test_small_causal_call_with_default_budget(shape, one_thread):
    """The reported cases, at the default 64 MiB budget (a 4 GiB mask is refused by the meter)."""
    q = torch.randn(*shape, requires_grad=True)
    model = Attend(causal=True)
    expected = _peak(model, q, q, q, grads=True).peak
    with probe.watch(model, every=1):
        extra = _peak(model, q, q, q, grads=True).peak - expected
    assert extra <= 64 * 2**20
