"""Several backward passes through one probed graph (issue 26, fault 5): ``backward(retain_graph=True)``
twice. Every gradient metric follows one rule, each pass adds its gradient's squares (two passes of
the same loss: sqrt(2) times one), with no warning; eager attention included, whose matmul keeps
reshaped copies of q and k rather than the tensors probe recorded."""

from __future__ import annotations

import gc
import math
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe
from tests.helpers import SDPAModel


class EagerAttention(nn.Module):
    """softmax(q·kᵀ·s)·v written out, q, k, v transposed views of their own projections: matmul
    copies q and k, so the graph keeps copies, not the tensors probe recorded."""

    def __init__(self, d_model: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.d = heads, d_model // heads
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.o = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, self.heads, self.d).transpose(1, 2) for f in (self.q, self.k, self.v))
        p = F.softmax(q @ k.transpose(-2, -1) * self.d ** -0.5, dim=-1)
        return self.o((p @ v).transpose(1, 2).reshape(b, n, -1))


GRADS = ("grad_logits", "grad_q", "grad_k", "grad_v")


def _grads(model, x, passes):
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, rows=None) as p:
            loss = model(x).square().sum()
            for i in range(passes):
                loss.backward(retain_graph=i < passes - 1 or passes > 1)
    mine = [str(w.message) for w in caught if str(w.message).startswith("probe:")]
    summary = p.summary()
    site = summary.sites[0]
    return {g: summary.value(site, g, "actual") for g in GRADS}, mine


@pytest.mark.parametrize("make", [lambda: EagerAttention(), lambda: SDPAModel(layers=1, d_model=32, heads=4)],
                         ids=["eager", "sdpa"])
def test_every_gradient_metric_counts_each_retained_pass(make):
    model = make()
    x = torch.randn(2, 6, 32)
    one, warned_one = _grads(model, x, 1)
    two, warned_two = _grads(model, x, 2)
    assert warned_one == [] and warned_two == []  # no "q, k, v were freed"
    for g in GRADS:
        assert torch.allclose(torch.as_tensor(two[g]), torch.as_tensor(one[g]) * math.sqrt(2), rtol=1e-6), g


def test_retained_passes_keep_nothing_alive_after_close():
    model = EagerAttention()
    x = torch.randn(2, 6, 32)
    p = probe.watch(model)
    loss = model(x).square().sum()
    loss.backward(retain_graph=True)
    loss.backward(retain_graph=True)
    p.close()
    refs = [weakref.ref(model)] + [weakref.ref(t) for t in model.parameters()]
    del model, loss
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert "grad_logits" in p.summary().metrics(p.summary().sites[0])


def _penalty_grads(model, x):
    params = [p for p in model.parameters()]
    loss = model(x).square().sum()
    first = torch.autograd.grad(loss, params, create_graph=True)  # a gradient penalty: second order
    (loss + sum(g.square().sum() for g in first)).backward()
    return [p.grad.clone() for p in params]


def test_a_second_order_pass_counts_as_a_pass_and_changes_no_gradient():
    """Eager attention (SDPA's CPU kernel has no second derivative in torch itself)."""
    import copy

    model = EagerAttention()
    x = torch.randn(2, 6, 32)
    bare = _penalty_grads(copy.deepcopy(model), x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, rows=None) as p:
            got = _penalty_grads(model, x)
    assert all(torch.equal(a, b) for a, b in zip(got, bare))
    assert [str(w.message) for w in caught if str(w.message).startswith("probe:")] == []
    summary = p.summary()
    for g in GRADS:
        assert all(math.isfinite(v) for v in summary.value(summary.sites[0], g, "actual")), g
