"""Query-row sampling in the backward (``rows=N``): ``grad_logits`` estimated from the sampled
rows, unbiased, with its documented variance, against a plain float64 computation written here."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe
from probe.call import AttentionCall
from probe.stats.backward import grad_logits_stats
from tests.helpers import masked_logits64
from tests.stats.test_rows_sampling import design_variance


def _per_row(q, k, v, dout, scale, causal, key_mask=None):
    """Per (batch, head, row) ``Σ_j (∂L/∂Z)²`` in float64, kv heads repeated for GQA."""
    z, valid = masked_logits64(q, k, scale, causal, key_mask)
    v64 = v.double().repeat_interleave(q.shape[1] // v.shape[1], 1)
    p = torch.softmax(torch.where(valid, z, -math.inf), -1).nan_to_num(0.0)
    dp = dout.double() @ v64.transpose(-1, -2)
    grad = p * (dp - (p * dp).sum(-1, keepdim=True))
    return grad.square().sum(-1)  # (B, H, L)


def _case(l, causal, padded, kv_heads=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 6, l, 8, generator=gen) * 1.5
    k, v = (torch.randn(2, kv_heads, l, 8, generator=gen) for _ in range(2))
    dout = torch.randn(2, 6, l, 8, generator=gen)
    key_mask = None
    if padded:
        key_mask = torch.ones(2, 1, 1, l, dtype=torch.bool)
        key_mask[1, ..., l - 2 :] = False
    call = AttentionCall(q=q, k=k, v=v, scale=0.5, causal=causal, mask=key_mask)
    return call, dout, _per_row(q, k, v, dout, 0.5, causal, key_mask)


@pytest.mark.parametrize("causal,padded,kv_heads", [(False, False, 6), (True, False, 3), (True, True, 3), (False, True, 2)])
def test_average_over_every_subset_is_the_exact_sum(causal, padded, kv_heads):
    l, n = 6, 2
    call, dout, y = _case(l, causal, padded, kv_heads)
    exact = y.sum((0, 2)).numpy()
    full = grad_logits_stats(call, dout, {"actual": 0.5})
    np.testing.assert_allclose(full["grad_logits_sq@actual"].numpy(), exact, rtol=1e-5)
    assert "grad_logits_var@actual" not in full  # every row: exact, no variance
    subsets = list(itertools.combinations(range(l), n))
    total = np.zeros(6)
    for subset in subsets:
        fields = grad_logits_stats(call, dout, {"actual": 0.5}, rows=torch.tensor(subset))
        total += fields["grad_logits_sq@actual"].numpy()
        # the variance estimate: L²(1 − N/L)/N · S_y², y the per-position sums over the batch
        ys = y[:, :, list(subset)].sum(0)
        var = ys.var(-1, unbiased=True) * (l * l * (1 - n / l) / n)
        np.testing.assert_allclose(fields["grad_logits_var@actual"].numpy(), var.numpy(), rtol=5e-3, atol=1e-12)  # float32 rows
    np.testing.assert_allclose(total / len(subsets), exact, rtol=1e-5)


def test_only_the_sampled_rows_are_formed():
    """Rows outside the sample do not matter: NaN there changes nothing."""
    call, dout, _ = _case(12, True, False)
    rows = torch.tensor([1, 4, 5, 9])
    before = grad_logits_stats(call, dout, {"actual": 0.5}, rows=rows)
    dout = dout.clone()
    dout[:, :, 7] = math.nan
    after = grad_logits_stats(call, dout, {"actual": 0.5}, rows=rows)
    for key in before:
        torch.testing.assert_close(before[key], after[key], rtol=0, atol=0)


class _Attend(nn.Module):
    def __init__(self, q, k, v):
        super().__init__()
        self.q, self.k, self.v = (nn.Parameter(t) for t in (q, k, v))

    def forward(self):
        return F.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=True)


def test_probe_rows_option_estimates_grad_logits_with_a_standard_error():
    call, _, _ = _case(128, True, False, kv_heads=6, seed=5)
    module = _Attend(call.q, call.k, call.v)
    steps = 4
    with probe.watch(module, rows=32) as p:
        for _ in range(steps):
            module.zero_grad()
            module().square().sum().backward()
    s = p.summary()
    site = s.sites[0]
    assert "grad_logits" in s.info(site)["rows"]
    with torch.no_grad():
        dout = 2 * F.scaled_dot_product_attention(call.q, call.k, call.v, is_causal=True)
    y = _per_row(call.q, call.k, call.v, dout, 8**-0.5, True)
    exact_total = y.sum((0, 2))
    exact = exact_total.sqrt().numpy()  # the same every step: the RMS over steps is one step's norm
    # the true standard error of the estimate, to first order, over `steps` independent draws
    var_total = design_variance(y.sum(0), 32) / steps
    se = (var_total.sqrt() / (2 * exact_total.sqrt())).numpy()
    got, se_reported = s.value(site, "grad_logits"), s.value(site, "grad_logits_se")
    assert (np.abs(got - exact) <= 4 * se).all()
    np.testing.assert_allclose(se_reported, se, rtol=0.5)
    with probe.watch(module) as p:  # the default: every row, exact, no standard error
        module.zero_grad()
        module().square().sum().backward()
    s = p.summary()
    np.testing.assert_allclose(s.value(s.sites[0], "grad_logits"), exact, rtol=1e-4)
    assert "grad_logits_se" not in s.metrics(s.sites[0])


@pytest.mark.parametrize("taken_bytes", [0, 2**30])
@pytest.mark.parametrize("causal,padded", [(False, True), (True, False)])
def test_the_sampled_rows_of_dout_are_taken_once_or_by_each_chunk_alike(monkeypatch, taken_bytes, causal, padded):
    """The sampled rows of ∂L/∂out are taken once and scaled by their own largest entry, or, past
    ``_TAKEN_BYTES``, by each chunk with the scale of all of dout: the same float64 reference
    either way, for a gradient of 1e30 (its squares overflow float32) whose row 7, not drawn,
    holds 3e38 (a scale from every row would shrink the sampled rows by 2⁻¹²⁸ more)."""
    from probe.stats import backward
    from probe.stats.sampling import row_design

    monkeypatch.setattr(backward, "_TAKEN_BYTES", taken_bytes)
    call, dout, y = _case(40, causal, padded)
    rows = torch.tensor([0, 3, 4, 9, 17, 18, 25, 31, 38, 39])
    dout = dout * 1e30
    dout[:, :, 7] = 3e38
    got = grad_logits_stats(call, dout, {"actual": 0.5}, budget_bytes=2**12, rows=rows)  # chunks of a few rows
    want = (y[:, :, rows] * row_design(rows, 40)[0]).sum((0, 2)) * 1e60
    torch.testing.assert_close(got["grad_logits_sq@actual"], want, rtol=1e-4, atol=0)
    assert torch.isfinite(got["grad_logits_var@actual"]).all()
