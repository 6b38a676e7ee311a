"""Empty attention calls run exactly as without probe: nothing to measure, no error, no warning.

Regression (issue 12, item 4): SDPA with batch 0 or S = 0 and nn.MultiheadAttention with batch 0
raised ``IndexError: amax()`` from the model's forward under probe.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe
from tests.helpers import hook_count


class Attend(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


class EagerAttend(nn.Module):
    """softmax(q·kᵀ / sqrt(d))·v written out, as eager implementations do."""

    def forward(self, q, k, v):
        w = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return w @ v


def _run(model, *inputs):
    """Output and input gradients of one forward + backward (inputs are copied fresh)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = model(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    (out.sum() + sum(t.sum() for t in leaves) * 0).backward()
    return out.detach(), [t.grad for t in leaves]


def _same(a, b):
    out_a, grads_a = a
    out_b, grads_b = b
    assert out_a.shape == out_b.shape
    torch.testing.assert_close(out_a, out_b, equal_nan=True, rtol=0, atol=0)
    for ga, gb in zip(grads_a, grads_b):
        assert (ga is None) == (gb is None)
        if ga is not None:
            torch.testing.assert_close(ga, gb, equal_nan=True, rtol=0, atol=0)


SDPA_SHAPES = {
    "batch0": ((0, 2, 4, 8), (0, 2, 4, 8)),
    "no-queries": ((1, 2, 0, 8), (1, 2, 4, 8)),
    "no-keys": ((1, 2, 4, 8), (1, 2, 0, 8)),
    "nothing": ((1, 2, 0, 8), (1, 2, 0, 8)),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shapes", list(SDPA_SHAPES.values()), ids=list(SDPA_SHAPES))
@pytest.mark.parametrize("module", [Attend, EagerAttend], ids=["sdpa", "eager"])
def test_empty_attention_call_runs_as_without_probe(module, shapes, causal):
    if module is EagerAttend and causal:
        pytest.skip("the eager module has no causal mask")
    q_shape, kv_shape = shapes
    q, k, v = torch.randn(q_shape), torch.randn(kv_shape), torch.randn(kv_shape)
    model = module(causal) if module is Attend else module()
    expected = _run(model, q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with probe.watch(model, every=1) as p:
            got = _run(model, q, k, v)
            got_again = _run(model, q, k, v)  # a second step flushes the first
            summary = p.summary()
    _same(expected, got)
    _same(expected, got_again)
    assert summary.sites == []  # nothing to measure
    assert hook_count(model) == 0


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_with_batch_0(batch_first):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first)
    x = torch.randn(0, 5, 16) if batch_first else torch.randn(5, 0, 16)
    expected = _run(mha, x, x, x)
    watched = copy.deepcopy(mha)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with probe.watch(watched, every=1) as p:
            got = _run(watched, x, x, x)
            summary = p.summary()
    _same(expected, got)
    assert summary.sites == []


def test_empty_batch_between_real_ones_keeps_statistics():
    """An empty micro-batch between real ones adds nothing and breaks nothing."""
    torch.manual_seed(0)
    model = Attend(causal=True)
    with probe.watch(model, every=1) as p:
        for batch in (2, 0, 2):
            _run(model, *(torch.randn(batch, 2, 6, 8) for _ in range(3)))
        summary = p.summary()
    assert summary.steps == 2  # the empty step had nothing to measure
    (site,) = summary.sites
    assert summary.value(site, "entropy").shape == (2,)
    assert "grad_logits" in summary.metrics(site)
