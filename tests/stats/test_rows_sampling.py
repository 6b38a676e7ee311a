"""Query-row sampling (``rows=N``): unbiased mean metrics, documented standard error.

The exact values come from a plain float64 computation over every row, written here; the
sampled estimates from :func:`probe.stats.forward.forward_stats`.
"""

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
from probe.stats.forward import forward_stats
from tests.helpers import masked_logits64

MEANS = {"entropy": "entropy@actual", "max_prob": "max_prob@actual", "saturation": "saturated@actual"}


def _per_row(q, k, scale, causal, key_mask=None, tau=0.9):
    """Per (batch, head, row): valid-row flag and the row's entropy / max prob / saturation, float64."""
    z, valid = masked_logits64(q, k, scale, causal, key_mask)
    z = torch.where(valid, z, -math.inf)
    p = torch.softmax(z, -1)
    n = valid.sum(-1)
    ok = n >= 2
    ent = -(torch.where(p > 0, p * torch.log(p), 0.0)).sum(-1) / torch.log(n.clamp(min=2).double())
    pmax = p.amax(-1)
    vals = {"entropy": ent, "max_prob": pmax, "saturation": (pmax >= tau).double()}
    return ok, {m: torch.where(ok, v, 0.0) for m, v in vals.items()}


def _estimate(fields, metric):
    return (fields[MEANS[metric]] / fields["rows"]).numpy()


def _inputs(l, b=2, h=3, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, l, d, generator=g) * 1.5, torch.randn(b, h, l, d, generator=g)


@pytest.mark.parametrize("causal,padded", [(False, False), (True, False), (True, True)])
def test_average_over_every_subset_is_the_exact_value(causal, padded):
    """Unbiasedness, exactly: averaged over all C(L, N) equally likely row sets, each
    Horvitz-Thompson estimate of the row sums divided by the exact valid-row count gives the
    exact mean."""
    l, n = 6, 2
    q, k = _inputs(l)
    key_mask = None
    if padded:
        key_mask = torch.ones(2, 1, 1, l, dtype=torch.bool)
        key_mask[1, ..., 4:] = False
    call = AttentionCall(q=q, k=k, v=None, scale=0.5, causal=causal, mask=key_mask)
    ok, vals = _per_row(q, k, 0.5, causal, key_mask)
    exact = {m: (v.sum((0, 2)) / ok.sum((0, 2))).numpy() for m, v in vals.items()}
    subsets = list(itertools.combinations(range(l), n))
    totals = {m: np.zeros(3) for m in MEANS}
    for subset in subsets:
        fields = forward_stats(call, {"actual": 0.5}, saturation=0.9, rows=torch.tensor(subset))
        np.testing.assert_array_equal(fields["rows"].numpy(), ok.sum((0, 2)).numpy())  # exact count
        for m in MEANS:
            totals[m] += _estimate(fields, m)
    for m in MEANS:
        np.testing.assert_allclose(totals[m] / len(subsets), exact[m], rtol=1e-5, atol=1e-6, err_msg=m)


def design_variance(y, sampled):
    """The variance of the stratified total of ``y`` (per-position totals, positions last) over
    ``sampled`` rows: Σ_h L_h²(1 − n_h/L_h)/n_h · S_h², S_h² over each stratum's positions."""
    from probe.stats.sampling import strata_sizes

    sizes, drawn = strata_sizes(y.shape[-1], sampled)
    out, start = 0.0, 0
    for size, n in zip(sizes.tolist(), drawn.tolist()):
        if n < size:
            out = out + size * size * (1 - n / size) / n * y[..., start : start + size].var(-1, unbiased=True)
        start += size
    return out


def _standard_error(y, n_rows, sampled):
    """SE of the mean estimate: sqrt(design_variance) / n_rows, y the per-position totals."""
    return (design_variance(y, sampled).sqrt() / n_rows).numpy()


def test_seeded_estimate_is_within_a_few_standard_errors():
    l, n = 256, 32
    q, k = _inputs(l, seed=1)
    call = AttentionCall(q=q, k=k, v=None, scale=0.4, causal=True)
    ok, vals = _per_row(q, k, 0.4, True)
    n_rows = ok.sum((0, 2)).double()
    fields = forward_stats(call, {"actual": 0.4}, saturation=0.9, rows=n, generator=torch.Generator().manual_seed(3))
    for m in MEANS:
        exact = (vals[m].sum((0, 2)) / n_rows).numpy()
        se = _standard_error(vals[m].sum(0), n_rows, n)  # y: per (head, position), summed over batch
        assert (se > 0).any()  # 0 where every varying row is in the whole head (saturation here)
        err = np.abs(_estimate(fields, m) - exact)
        assert (err <= 4 * se + 1e-9).all(), (m, err, se)


def test_mean_over_many_seeds_matches_the_exact_value():
    l, n, draws = 48, 6, 300
    q, k = _inputs(l, seed=2)
    call = AttentionCall(q=q, k=k, v=None, scale=0.4)
    ok, vals = _per_row(q, k, 0.4, False)
    n_rows = ok.sum((0, 2)).double()
    gen = torch.Generator().manual_seed(0)
    estimates = {m: [] for m in MEANS}
    for _ in range(draws):
        fields = forward_stats(call, {"actual": 0.4}, saturation=0.9, rows=n, generator=gen)
        for m in MEANS:
            estimates[m].append(_estimate(fields, m))
    for m in MEANS:
        exact = (vals[m].sum((0, 2)) / n_rows).numpy()
        se_mean = _standard_error(vals[m].sum(0), n_rows, n) / math.sqrt(draws)
        mean = np.mean(estimates[m], axis=0)
        assert (np.abs(mean - exact) <= 4 * se_mean + 1e-12).all(), (m, mean, exact, se_mean)


@pytest.mark.parametrize("causal", [False, True])
def test_logit_moments_and_counts_stay_exact_and_rows_at_least_length_is_exact(causal):
    q, k = _inputs(40, seed=4)
    call = AttentionCall(q=q, k=k, v=None, scale=0.3, causal=causal)
    full = forward_stats(call, {"actual": 0.3})
    sampled = forward_stats(call, {"actual": 0.3}, rows=5, generator=torch.Generator().manual_seed(1))
    for field in ("logit@actual", "logit_max@actual", "rows", "nonfinite"):
        torch.testing.assert_close(sampled[field], full[field], msg=field)
    assert "entropy_var@actual" in sampled and "entropy_var@actual" not in full
    same = forward_stats(call, {"actual": 0.3}, rows=40)
    for field in full:
        torch.testing.assert_close(same[field], full[field])


class _Attend(nn.Module):
    def __init__(self, q, k, v):
        super().__init__()
        self.qkv = (q, k, v)

    def forward(self):
        return F.scaled_dot_product_attention(*self.qkv, is_causal=True)


def test_probe_rows_option_estimates_and_says_so_in_info():
    q, k = _inputs(128, seed=5)
    v = torch.randn_like(k)
    module = _Attend(q, k, v)
    with probe.watch(module, rows=32, grads=False) as p:
        for _ in range(4):
            module()
    s = p.summary()
    site = s.sites[0]
    assert "32 of 128" in s.info(site)["rows"] and "standard error" in s.info(site)["rows"]
    se_reported = s.value(site, "entropy_se")
    assert np.isfinite(se_reported).all() and (se_reported > 0).all()
    ok, vals = _per_row(q, k, q.shape[-1] ** -0.5, True, tau=0.99)
    exact = (vals["entropy"].sum((0, 2)) / ok.sum((0, 2))).numpy()
    se = _standard_error(vals["entropy"].sum(0), ok.sum((0, 2)).double(), 32) / 2  # 4 draws
    assert (np.abs(s.value(site, "entropy") - exact) <= 4 * se).all()
    # the reported standard error estimates the true one (4 calls of 32 rows each)
    np.testing.assert_allclose(se_reported, se, rtol=0.5)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "10", True])
def test_bad_rows_argument(bad):
    with pytest.raises(probe.ProbeError, match="`rows`"):
        probe.watch(nn.Linear(2, 2), rows=bad)


@pytest.mark.parametrize("rows", list(itertools.combinations(range(1, 10), 3)))
def test_left_padding_is_a_ratio_not_a_share_of_valid_rows(rows):
    """Left padding under causal masking: the first query rows of a padded sequence see no key
    (no valid row). Every valid row here attends uniformly (q = 0: normalized entropy exactly 1),
    so every sample must estimate entropy 1; a Horvitz-Thompson total divided by the exact row
    count gave the sample's share of valid rows instead (1.16 on a 12-token Llama batch)."""
    q = torch.zeros(2, 2, 10, 4)
    k = torch.randn(2, 2, 10, 4, generator=torch.Generator().manual_seed(0))
    pad = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    pad[1, ..., :4] = False  # the second sequence starts at position 4
    call = AttentionCall(q=q, k=k, v=None, scale=1.0, causal=True, mask=pad)
    positions = torch.tensor((0,) + rows)
    fields = forward_stats(call, {"actual": 1.0}, rows=positions)
    exact = forward_stats(call, {"actual": 1.0})
    assert torch.equal(fields["rows"], exact["rows"])
    np.testing.assert_allclose((fields["entropy@actual"] / fields["rows"]).numpy(), 1.0, rtol=1e-6)
    assert torch.all(fields["entropy_var@actual"] >= 0)


def test_chunk_picks_split_the_sorted_positions_by_chunk():
    """Each chunk's sampled rows, local to it: the positions in [r0, r0 + step) minus r0, empty
    where none was drawn (one host split of the sorted positions, not a mask per chunk)."""
    from types import SimpleNamespace

    from probe.stats.plan import chunk_picks

    gen = torch.Generator().manual_seed(2)
    for length, step, count in [(128, 32, 9), (100, 7, 40), (64, 64, 5), (50, 16, 0), (33, 1, 33)]:
        positions = torch.randperm(length, generator=gen)[:count].sort().values
        call = SimpleNamespace(causal=False, q=torch.empty(1, 1, length, 4))
        plan = SimpleNamespace(length=length, step=step, positions=positions)
        _, picks = chunk_picks(call, plan)  # type: ignore[arg-type]
        assert len(picks) == -(-length // step)
        for c, pick in enumerate(picks):
            r0 = c * step
            expected = positions[(positions >= r0) & (positions < r0 + step)] - r0
            assert pick is not None and pick.dtype == torch.long and torch.equal(pick, expected)


@pytest.mark.parametrize("budget", [2**11, 2**13, 2**20])
def test_sampled_rows_without_causal_masking_are_exactly_the_rows_drawn(monkeypatch, budget):
    """Without causal masking the centred path runs the sampled rows first (their exponentials on
    the chunk's product in place, no gather): each estimate is the design-weighted sum of the
    drawn rows' float64 values, whether the drawn rows fill several chunks, share one with rows
    not drawn, or all fit in one (budgets of a few rows per chunk to every row), with key padding
    and two query heads per kv head."""
    from probe.stats import plan as plan_module
    from probe.stats.paths import centred
    from probe.stats.sampling import row_design, sample_rows

    monkeypatch.setattr(plan_module, "blocked_keys", lambda *args: False)
    steps = []
    real = centred.centred_rows
    monkeypatch.setattr(centred, "centred_rows", lambda *a, **k: steps.append(a[3]) or real(*a, **k))
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(2, 4, 40, 8, generator=g) * 1.5, torch.randn(2, 2, 40, 8, generator=g)
    pad = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    pad[1, ..., 29:] = False
    positions = sample_rows(40, 11, torch.Generator().manual_seed(2))
    call = AttentionCall(q=q, k=k, v=None, scale=0.5, causal=False, mask=pad)
    fields = forward_stats(call, {"actual": 0.5}, saturation=0.9, budget_bytes=budget, rows=positions)
    assert steps and (steps[0] < 11 if budget < 2**20 else steps[0] >= 40)
    ok, vals = _per_row(q, k, 0.5, False, pad)
    weight = row_design(positions, 40)[0]
    for metric in ("entropy", "max_prob"):
        want = (vals[metric][:, :, positions] * weight).sum((0, 2))
        np.testing.assert_allclose(fields[MEANS[metric]].double().numpy(), want.numpy(), rtol=2e-5, err_msg=metric)
    np.testing.assert_array_equal(fields["rows"].numpy(), ok.sum((0, 2)).numpy())
