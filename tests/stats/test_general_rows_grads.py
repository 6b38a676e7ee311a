"""The backward's general path (bias, softcap, per-head or non-positive scales, ``grad_probs``, own
logits) with sampled query rows: Horvitz-Thompson estimates of ``Σ (∂L/∂Z)²`` and their variances
against float64 computations written here on the same positions."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch

from probe.call import AttentionCall
from probe.stats import plan
from probe.stats.backward import grad_logits_stats
from probe.stats.sampling import row_design, sample_rows, stratified_variance
from tests.stats.test_general_rows import _case, _logits64, _valid


def _probs64(call, sigma):
    valid = _valid(call.q, call.k, call.causal, call.mask, call.bias)
    _, z = _logits64(call.q, call.k, sigma)
    if call.softcap is not None:
        z = call.softcap * torch.tanh(z / call.softcap)
    if call.bias is not None:
        z = z + torch.where(call.bias <= -100, 0.0, call.bias.double())
    return torch.softmax(torch.where(valid, z, -math.inf), -1).nan_to_num(0.0)


def _per_row(p, dp):
    g = p * (dp - (p * dp).sum(-1, keepdim=True))
    return g.square().sum(-1)  # (B, H, L)


def _with_v(call, seed=1):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(call.k.shape[0], call.k.shape[1], call.k.shape[2], 8, generator=g)
    dout = torch.randn(*call.q.shape[:3], 8, generator=g)
    return dataclasses.replace(call, v=v), dout


def _dp64(call, dout):
    v64 = call.v.double().repeat_interleave(call.q.shape[1] // call.v.shape[1], 1)
    return dout.double() @ v64.transpose(-1, -2)


def _scales(call):
    return {"actual": call.scale, "unscaled": 1.0, "negative": -0.5}


def _check(fields, y, positions, length, name):
    weight, stratum, sizes, drawn = row_design(positions, length)
    picked = y[:, :, positions]
    np.testing.assert_allclose(fields[f"grad_logits_sq@{name}"].numpy(), (picked * weight).sum((0, 2)).numpy(),
                               rtol=2e-5, atol=1e-9, err_msg=name)
    var = stratified_variance(picked.sum(0), stratum, sizes, drawn)
    np.testing.assert_allclose(fields[f"grad_logits_var@{name}"].numpy(), var.numpy(), rtol=1e-3, atol=1e-12,
                               err_msg=f"var {name}")


@pytest.mark.parametrize("proven", [True, False])
@pytest.mark.parametrize("causal,padded,gqa", [(True, True, True), (False, False, False), (False, True, True)])
def test_sampled_grad_logits_equal_float64_weighted_sums(monkeypatch, proven, causal, padded, gqa):
    call, dout = _with_v(_case(causal, padded, gqa))
    if not proven:
        monkeypatch.setattr(plan, "proven_finite", lambda c, v: (False, True))
    length = call.q.shape[2]
    positions = sample_rows(length, 9, torch.Generator().manual_seed(5))
    budget = 8 * 4 * 2 * 4 * length * 5  # chunks of 5 rows
    fields = grad_logits_stats(call, dout, _scales(call), budget, rows=positions)
    full = grad_logits_stats(call, dout, _scales(call), budget)
    dp = _dp64(call, dout)
    for name, sigma in _scales(call).items():
        y = _per_row(_probs64(call, sigma), dp)
        _check(fields, y, positions, length, name)
        np.testing.assert_allclose(full[f"grad_logits_sq@{name}"].numpy(), y.sum((0, 2)).numpy(), rtol=2e-5)
        assert f"grad_logits_var@{name}" not in full


def test_grad_probs_in_a_bmm_layout_and_own_logits_are_sampled_too():
    call, _ = _with_v(_case(True, True, True))
    b, h, length, s = *call.q.shape[:3], call.k.shape[2]
    dprobs = torch.randn(b * h, length, s, generator=torch.Generator().manual_seed(7))
    positions = sample_rows(length, 9, torch.Generator().manual_seed(2))
    scales = _scales(call)
    fields = grad_logits_stats(call, None, scales, grad_probs=dprobs, rows=positions)
    dp = dprobs.double().reshape(b, h, length, s)
    for name, sigma in scales.items():
        _check(fields, _per_row(_probs64(call, sigma), dp), positions, length, name)
    # the call's own logits (scale unknown): P = softmax(logits), masked entries finfo.min
    p = _probs64(call, call.scale)
    logits = torch.log(p).clamp(min=torch.finfo(torch.float32).min).float()
    own = dataclasses.replace(call, logits=logits.reshape(b * h, length, s))
    fields = grad_logits_stats(own, None, {"actual": None}, grad_probs=dprobs, rows=positions)
    _check(fields, _per_row(p, dp), positions, length, "actual")


def test_average_over_every_subset_is_the_exact_sum():
    call, dout = _with_v(_case(True, True, True, l=6))
    scales = _scales(call)
    full = grad_logits_stats(call, dout, scales)
    subsets = list(itertools.combinations(range(6), 2))
    total = {name: 0.0 for name in scales}
    for subset in subsets:
        fields = grad_logits_stats(call, dout, scales, rows=torch.tensor(subset))
        for name in scales:
            total[name] = total[name] + fields[f"grad_logits_sq@{name}"].double()
    for name in scales:
        np.testing.assert_allclose((total[name] / len(subsets)).numpy(), full[f"grad_logits_sq@{name}"].numpy(),
                                   rtol=1e-5)


def test_only_the_sampled_rows_are_formed():
    call, dout = _with_v(_case(True, False, True))
    rows = torch.tensor([1, 4, 5, 9, 15])
    before = grad_logits_stats(call, dout, _scales(call), rows=rows)
    dout = dout.clone()
    dout[:, :, 7] = math.nan
    after = grad_logits_stats(call, dout, _scales(call), rows=rows)
    assert before.keys() == after.keys() and "grad_logits_var@negative" in before
    for key in before:
        torch.testing.assert_close(before[key], after[key], rtol=0, atol=0)


def test_every_position_sampled_is_exact_and_empty_calls_give_nothing():
    call, dout = _with_v(_case())
    length = call.q.shape[2]
    exact = grad_logits_stats(call, dout, _scales(call))
    same = grad_logits_stats(call, dout, _scales(call), rows=torch.arange(length))
    assert same.keys() == exact.keys()
    for key in exact:
        torch.testing.assert_close(same[key], exact[key], rtol=0, atol=0)
    empty = AttentionCall(q=call.q[:, :, :0], k=call.k, v=call.v, scale=call.scale, bias=call.bias[:, :, :0])
    assert grad_logits_stats(empty, dout[:, :, :0], _scales(call), rows=torch.tensor([], dtype=torch.long)) == {}


def test_sampled_general_backward_runs_on_meta():
    """No host synchronization: bias + softcap + causal + padding, grad_output and grad_probs."""
    meta = dict(device="meta")
    q, k, v = torch.empty(2, 8, 300, 64, **meta), torch.empty(2, 2, 300, 64, **meta), torch.empty(2, 2, 300, 32, **meta)
    call = AttentionCall(q=q, k=k, v=v, scale=0.125, bias=torch.empty(2, 1, 300, 300, **meta),
                         mask=torch.empty(2, 1, 1, 300, dtype=torch.bool, **meta), causal=True, softcap=30.0)
    scales = {"actual": 0.125, "unscaled": 1.0, "negative": -0.5}
    rows = sample_rows(300, 17, torch.Generator().manual_seed(0))
    for kw in (dict(grad_output=torch.empty(2, 8, 300, 32, **meta)),
               dict(grad_output=None, grad_probs=torch.empty(16, 300, 300, **meta))):
        fields = grad_logits_stats(call, scales=scales, budget_bytes=2**22, rows=rows, **kw)
        assert set(fields) == {f"grad_logits_{f}@{s}" for s in scales for f in ("sq", "var")}
        assert all(t.device.type == "meta" and t.shape == (8,) for t in fields.values())
