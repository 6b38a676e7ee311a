"""The general path (bias, softcap, per-head or non-positive scales) with sampled query rows.

References are float64 computations written here: per-row softmax metrics of
``Z = c·tanh(σ·q·kᵀ/c) + A`` over the valid keys (mask, causal, a bias not at or below -100),
the ratio estimator with the design's weights (probe.stats.sampling.row_design) on the same
positions (the mean over the sampled valid rows times the exact valid-row count, as the shifted
path), and the stratified variance of the batch sums of its residuals. Exact fields (moments, max, row count, nonfinite) are
compared with their float64 values over every row.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch

from probe.call import AttentionCall
from probe.stats import buffers, plan
from probe.stats.forward import forward_stats
from probe.stats.paths import general
from probe.stats.sampling import row_design, sample_rows, stratified_variance

TAU = 0.9


def _valid(q, k, causal, mask, bias):
    b, h, l, s = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    valid = torch.ones(b, h, l, s, dtype=torch.bool)
    if causal:
        valid &= torch.ones(l, s, dtype=torch.bool).tril()
    if mask is not None:
        valid &= mask
    if bias is not None:
        valid &= ~(bias <= -100)  # a NaN bias masks nothing
    return valid


def _logits64(q, k, sigma):
    k64 = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    r = q.double() @ k64.transpose(-1, -2)
    s = sigma.double().view(1, -1, 1, 1) if isinstance(sigma, torch.Tensor) else sigma
    return r, r * s


def reference(call, sigma):
    """Per (batch, head, row) float64 entropy / max_prob / saturated (0 on rows with < 2 keys),
    the valid-row flags, and the exact moments / max / nonfinite-free check."""
    valid = _valid(call.q, call.k, call.causal, call.mask, call.bias)
    r, z = _logits64(call.q, call.k, sigma)
    if call.softcap is not None:
        z = call.softcap * torch.tanh(z / call.softcap)
    if call.bias is not None:
        z = z + torch.where(call.bias <= -100, 0.0, call.bias.double())
    z = torch.where(valid, z, -math.inf)
    p = torch.softmax(z, -1).nan_to_num(0.0)
    n = valid.sum(-1)
    ok = n >= 2
    ent = -(torch.where(p > 0, p * torch.log(p), 0.0)).sum(-1) / torch.log(n.clamp(min=2).double())
    pmax = p.amax(-1)
    rows = {"entropy": ent, "max_prob": pmax, "saturated": (pmax >= TAU).double()}
    rows = {m: torch.where(ok, v, 0.0) for m, v in rows.items()}
    _, zs = _logits64(call.q, call.k, sigma)  # σR, before the cap
    heads = []
    for h in range(call.q.shape[1]):
        vals = zs[:, h][valid[:, h]]
        heads.append((vals.numel(), vals.mean().item(), vals.var(unbiased=False).item() * vals.numel(), vals.max().item()))
    return ok, rows, np.array(heads)


def _case(causal=True, padded=True, gqa=True, nan=None, l=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, h, d = 2, 4, 8
    hk = 2 if gqa else h
    q = torch.randn(b, h, l, d, generator=g) * 1.5
    k = torch.randn(b, hk, l, d, generator=g)
    bias = torch.randn(1, h, l, l, generator=g) * 2
    bias[0, 1, 3, :] = -math.inf  # a fully masked row in head 1 (by the bias)
    bias[0, 2, :, 5] = torch.finfo(torch.float32).min  # a key masked by the bias (HF style)
    mask = None
    if padded:
        mask = torch.ones(b, 1, 1, l, dtype=torch.bool)
        mask[1, ..., l - 5 :] = False
    if nan is not None:
        q[0, 1, nan, 0] = math.nan
    sigma = torch.tensor([0.3, -0.4, 0.25, 0.5])
    return AttentionCall(q=q, k=k, v=None, scale=sigma, causal=causal, mask=mask, bias=bias, softcap=4.0)


def _scales(call):
    return {"actual": call.scale, "unscaled": 1.0, "negative": -0.5}


@pytest.mark.parametrize("proven", [True, False])
@pytest.mark.parametrize("causal,padded,gqa", [(True, True, True), (False, False, False), (False, True, True)])
def test_sampled_estimates_equal_float64_weighted_sums_on_the_same_rows(monkeypatch, proven, causal, padded, gqa):
    call = _case(causal, padded, gqa)
    if not proven:  # the path every non-CPU device takes: counts and selected masks
        monkeypatch.setattr(plan, "proven_finite", lambda c, v: (False, True))
        monkeypatch.setattr(general, "all_finite", lambda x: False)
    length = call.q.shape[2]
    positions = sample_rows(length, 9, torch.Generator().manual_seed(5))
    budget = 6 * 4 * 2 * 4 * length * 5  # chunks of 5 rows
    fields = forward_stats(call, _scales(call), saturation=TAU, budget_bytes=budget, rows=positions)
    full = forward_stats(call, _scales(call), saturation=TAU, budget_bytes=budget)
    weight, stratum, sizes, drawn = row_design(positions, length)
    for name, sigma in _scales(call).items():
        ok, rows, heads = reference(call, sigma)
        n_rows = ok.sum((0, 2)).double()
        np.testing.assert_array_equal(fields["rows"].numpy(), n_rows.numpy())
        x = ok[:, :, positions].double()  # the ratio estimator over the sampled valid rows
        x_hat = (x * weight).sum((0, 2))
        for metric, y in rows.items():
            picked = y[:, :, positions]  # (B, H, N)
            ratio = (picked * weight).sum((0, 2)) / x_hat
            total = ratio * n_rows
            got = fields[f"{metric}@{name}"]
            np.testing.assert_allclose(got.numpy(), total.numpy(), rtol=2e-5, atol=1e-5, err_msg=f"{metric}@{name}")
            residual = picked - ratio.view(1, -1, 1) * x
            var = stratified_variance(residual.sum(0), stratum, sizes, drawn) * (n_rows / x_hat) ** 2
            np.testing.assert_allclose(fields[f"{metric}_var@{name}"].numpy(), var.numpy(), rtol=1e-4, atol=1e-6,
                                       err_msg=f"{metric}_var@{name}")
            # every row: the exact sums
            np.testing.assert_allclose(full[f"{metric}@{name}"].numpy(), y.sum((0, 2)).numpy(), rtol=2e-5, atol=1e-5)
            assert f"{metric}_var@{name}" not in full
        # exact fields, sampled or not: count, mean, M2 and max of σR over valid entries
        for f in (fields, full):
            n, mean, m2 = f[f"logit@{name}"].numpy()
            np.testing.assert_array_equal(n, heads[:, 0])
            np.testing.assert_allclose(mean, heads[:, 1], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(m2, heads[:, 2], rtol=1e-5)
            np.testing.assert_allclose(f[f"logit_max@{name}"].numpy(), heads[:, 3], rtol=1e-5)
        assert float(fields["nonfinite"].sum()) == 0 and float(full["nonfinite"].sum()) == 0


@pytest.mark.parametrize("causal", [False, True])
def test_average_over_every_subset_is_the_exact_value(causal):
    """Unbiased: over all C(L, N) equally likely row sets (the design for N = 2 of 6: one
    stratum, uniform), the estimates average to the exact totals (the ratio estimator is unbiased
    where every position has the same number of valid rows: no fully masked row here)."""
    call = _case(causal, True, True, l=6)
    bias = call.bias.clone()
    bias[0, 1, 3, :] = 0.5
    call = dataclasses.replace(call, bias=bias)
    scales = _scales(call)
    full = forward_stats(call, scales, saturation=TAU)
    subsets = list(itertools.combinations(range(6), 2))
    acc = {key: 0.0 for key in full if key.split("@")[0] in ("entropy", "max_prob", "saturated")}
    for subset in subsets:
        fields = forward_stats(call, scales, saturation=TAU, rows=torch.tensor(subset))
        for key in acc:
            acc[key] = acc[key] + fields[key].double()
        for key in full:
            if key.split("@")[0] not in ("entropy", "max_prob", "saturated"):
                torch.testing.assert_close(fields[key], full[key], rtol=1e-6, atol=1e-6, msg=key)
    for key, total in acc.items():
        np.testing.assert_allclose((total / len(subsets)).numpy(), full[key].double().numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=key)


def test_every_position_sampled_is_the_exact_path():
    call = _case()
    length = call.q.shape[2]
    exact = forward_stats(call, _scales(call))
    for rows in (length, torch.arange(length), length + 3):
        same = forward_stats(call, _scales(call), rows=rows)
        assert same.keys() == exact.keys()
        for key in exact:
            torch.testing.assert_close(same[key], exact[key], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("row", [2, 11])
def test_nonfinite_counts_stay_exact_on_unsampled_rows(row):
    """A NaN logit row is counted (its logits and its probabilities at `actual`) whether or not
    the row is sampled, on both the proven-finite and the counting path."""
    call = _case(causal=False, padded=False, nan=row)
    positions = torch.tensor([0, 1, 2, 5, 8, 13, 17, 20])
    fields = forward_stats(call, _scales(call), rows=positions)
    full = forward_stats(call, _scales(call))
    valid = _valid(call.q, call.k, False, None, call.bias)
    expected = np.zeros(4)
    expected[1] = 2 * valid[0, 1, row].sum().item()  # the NaN row's logits and probabilities
    np.testing.assert_array_equal(fields["nonfinite"].numpy(), expected)
    np.testing.assert_array_equal(full["nonfinite"].numpy(), expected)
    assert torch.isnan(fields["logit@actual"][1:, 1]).all()  # moments of a NaN head are NaN
    sampled_nan = row in positions.tolist()
    assert bool(torch.isnan(fields["entropy@actual"][1])) == sampled_nan
    assert torch.isfinite(fields["entropy@actual"][[0, 2, 3]]).all()


def test_a_huge_counterfactual_scale_is_counted_not_proven_finite():
    """σ·R beyond float32 at `actual`: every valid row's softmax is non-finite, as over all rows."""
    call = dataclasses.replace(_case(causal=False, padded=False), softcap=None)
    scales = {"actual": 1e38, "unscaled": 1.0}
    positions = torch.tensor([0, 3, 7, 12, 19])
    fields = forward_stats(call, scales, rows=positions)
    full = forward_stats(call, scales)
    torch.testing.assert_close(fields["nonfinite"], full["nonfinite"], rtol=0, atol=0)
    assert float(full["nonfinite"].sum()) > 0


@pytest.mark.parametrize("sigma", [math.nan, torch.tensor([0.1, math.nan, 0.2, 0.3])])
def test_a_nan_scale_is_counted(sigma):
    call = dataclasses.replace(_case(causal=False, padded=False), scale=sigma)
    for rows in (None, torch.tensor([0, 3, 7, 12, 19])):
        fields = forward_stats(call, {"actual": sigma, "unscaled": 1.0}, rows=rows)
        assert float(fields["nonfinite"].sum()) > 0


def test_bias_without_masked_entries_takes_no_mask():
    """A bias whose min is above -100 masks nothing (proven on the host): same values as with
    the masks built."""
    call = _case(causal=False, padded=False)
    bias = call.bias.clamp(min=-50)
    call = dataclasses.replace(call, bias=bias)
    positions = torch.tensor([0, 3, 7, 12, 19])
    a = forward_stats(call, _scales(call), rows=positions)
    orig = plan.proven_finite
    plan.proven_finite = lambda c, v: (orig(c, v)[0], True)
    try:
        b = forward_stats(call, _scales(call), rows=positions)
    finally:
        plan.proven_finite = orig
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-6, msg=key)


@pytest.mark.parametrize("shape", [(0, 4, 8, 8), (2, 0, 8, 8), (2, 4, 0, 8)])
def test_empty_calls(shape):
    b, h, l, d = shape
    q = torch.randn(b, h, l, d)
    k = torch.randn(b, h, 8, d)
    call = AttentionCall(q=q, k=k, v=None, scale=-0.5, bias=torch.zeros(1, 1, l, 8))
    assert forward_stats(call, {"actual": -0.5}, rows=4) == {}


@pytest.mark.parametrize("rows", [None, torch.tensor([0, 3, 7, 12, 19])])
def test_a_nan_bias_entry_reaches_nonfinite_sampled_or_not(rows):
    """A NaN bias masks nothing: its row's softmax is NaN (as in the model), counted exactly."""
    call = _case(causal=False, padded=False)
    bias = call.bias.clone()
    bias[0, 2, 4, 6] = math.nan  # broadcast over the batch: row 4 of head 2 in both elements
    call = dataclasses.replace(call, bias=bias)
    fields = forward_stats(call, _scales(call), rows=rows)
    valid = _valid(call.q, call.k, False, None, bias)
    expected = np.zeros(4)
    expected[2] = valid[:, 2, 4].sum().item()
    np.testing.assert_array_equal(fields["nonfinite"].numpy(), expected)


def test_buffers_kept_between_calls_change_nothing(monkeypatch):
    """A thread keeps its general-path buffers for the next call (CPUs, within KEEP_BYTES): calls
    of other shapes in between, forward or backward, leave the results as fresh buffers give."""
    a = _case(causal=True, padded=True, l=24)
    b = _case(causal=False, padded=False, gqa=False, l=40, seed=3)
    first = forward_stats(a, _scales(a), rows=torch.tensor([0, 5, 9, 17]))
    assert buffers.kept()
    forward_stats(b, _scales(b))
    again = forward_stats(a, _scales(a), rows=torch.tensor([0, 5, 9, 17]))
    for key in first:
        torch.testing.assert_close(again[key], first[key], rtol=0, atol=0, equal_nan=True)
    monkeypatch.setattr(buffers, "KEEP_BYTES", 0)
    buffers.forget()
    forward_stats(a, _scales(a))
    assert not buffers.kept()  # over the limit: not kept


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_head", [True, False])
def test_logits_whose_squares_overflow_float32_are_measured_again_rescaled(monkeypatch, causal, per_head):
    """Raw logits near 1e20 at scales near 1e-20 (so an ordinary softmax: σR as in ``_case``),
    with a bias that masks, a soft cap, padding, GQA, and per-head scales of both signs: each row's
    float32 sum of squared logits overflows, so the call proven finite is measured again on q, k
    scaled by 2^-32 at scales 2^64 larger. Moments, maxima (the min for the negative scale) and
    the softmax metrics match float64; ``logit_var`` read inf before. With logits 2^32 times
    smaller the first measurement stands."""
    import probe.stats.forward as forward

    again = []
    real = forward._rescaled_rows
    monkeypatch.setattr(forward, "_rescaled_rows", lambda *a: again.append(1) or real(*a))
    base = _case(causal=causal, padded=True, gqa=True)
    sigma = base.scale * 1e-20 if per_head else 0.3e-20
    call = dataclasses.replace(base, q=base.q * 1e10, k=base.k * 1e10, scale=sigma)
    scales = {"actual": sigma}
    _, p = plan.plan_call(call, scales, 2**14)
    assert p.path == "general" and p.proven
    full = forward_stats(call, scales, saturation=TAU, budget_bytes=2**14)
    assert again
    ok, rows, heads = reference(call, sigma)
    n, mean, m2 = full["logit@actual"].numpy()
    np.testing.assert_array_equal(n, heads[:, 0])
    np.testing.assert_allclose(mean, heads[:, 1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(m2, heads[:, 2], rtol=1e-5)
    np.testing.assert_allclose(full["logit_max@actual"].numpy(), heads[:, 3], rtol=1e-5)
    for metric, y in rows.items():
        np.testing.assert_allclose(full[f"{metric}@actual"].numpy(), y.sum((0, 2)).numpy(), rtol=2e-5, atol=1e-5,
                                   err_msg=metric)
    assert float(full["nonfinite"].sum()) == 0
    again.clear()
    smaller = dataclasses.replace(call, q=call.q * 2.0**-32, k=call.k * 2.0**-32, scale=sigma * 2.0**64)
    got = forward_stats(smaller, {"actual": smaller.scale}, saturation=TAU, budget_bytes=2**14)
    assert not again
    np.testing.assert_allclose(got["logit@actual"].numpy(), full["logit@actual"].numpy(), rtol=1e-5, atol=1e-5)
