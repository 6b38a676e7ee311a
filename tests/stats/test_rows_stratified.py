"""The stratified design of ``rows=N`` (probe.stats.sampling): which positions it draws, and that
its Horvitz-Thompson totals and their variance estimates are unbiased, by enumerating every
sample the design can draw, forward and backward, against float64 references written here."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from probe.call import AttentionCall
from probe.stats.forward import forward_stats
from probe.stats.backward import grad_logits_stats
from probe.stats.sampling import row_design, sample_rows, strata_sizes, stratified_variance
from tests.stats.test_rows_sampling import _inputs, _per_row
from tests.stats.test_rows_sampling_grads import _case


@pytest.mark.parametrize("length,rows", [(10, 4), (11, 5), (1000, 256), (257, 256), (9, 1), (7, 3)])
def test_the_design_draws_its_counts_in_consecutive_strata(length, rows):
    sizes, drawn = strata_sizes(length, rows)
    assert int(sizes.sum()) == length and int(drawn.sum()) == rows
    head = rows // 4  # the first N // 4 positions, drawn whole
    assert (sizes >= drawn).all() and (sizes[1 if head else 0:].max() - sizes[1 if head else 0:].min()) <= 1
    assert drawn.shape[0] == max(1, (rows - head) // 2) + (1 if head else 0)
    if head:
        assert int(sizes[0]) == int(drawn[0]) == head
    pos = sample_rows(length, rows, torch.Generator().manual_seed(0))
    assert pos.shape == (rows,) and (pos[1:] > pos[:-1]).all() and 0 <= int(pos[0]) and int(pos[-1]) < length
    bounds = torch.cumsum(sizes, 0)
    assert torch.equal(torch.bincount(torch.searchsorted(bounds, pos, right=True), minlength=len(sizes)), drawn)
    weight, _, _, _ = row_design(pos, length)
    assert weight.sum().item() == pytest.approx(length)  # a total of ones is estimated exactly
    again = sample_rows(length, rows, torch.Generator().manual_seed(0))
    assert torch.equal(pos, again)  # the same generator state, the same positions


def test_positions_drawn_here_skip_the_design_check_until_they_change():
    """Positions from sample_rows are known to follow the design: row_design returns the cached
    design of (L, N) for them without checking, the same as the check gives; changed in place
    (or asked about for another length) they are checked again, and a subset that does not
    follow the design is one uniform sample."""
    from probe.stats import sampling

    pos = sample_rows(40, 8, torch.Generator().manual_seed(3))
    checked = row_design(pos.clone(), 40)  # a copy: not drawn here, checked
    design = row_design(pos, 40)
    assert design is sampling._drawn_design(8, 40)
    assert all(torch.equal(a, b) for a, b in zip(design, checked))
    pos.copy_(torch.arange(8))  # rows 0..7: six in the first sampled stratum
    uniform = row_design(pos, 40)
    assert uniform[2].tolist() == [40] and uniform[3].tolist() == [8]
    other = sample_rows(40, 8, torch.Generator().manual_seed(3))
    for length in (41, 100):  # drawn for 40: checked for another length, as a copy is
        assert all(torch.equal(a, b) for a, b in zip(row_design(other, length), row_design(other.clone(), length)))
    assert row_design(other, 100)[2].tolist() == [100]  # they do not follow (100, 8)'s strata


def test_every_position_is_drawn_with_its_stratum_probability():
    length, rows, draws = 11, 5, 4000
    gen = torch.Generator().manual_seed(1)
    hits = torch.zeros(length)
    for _ in range(draws):
        hits[sample_rows(length, rows, gen)] += 1
    sizes, drawn = strata_sizes(length, rows)
    expected = torch.repeat_interleave(drawn.double() / sizes.double(), sizes)
    se = (expected * (1 - expected) / draws).sqrt()
    assert ((hits / draws - expected).abs() <= 4 * se).all()


def _designs(length, rows):
    """Every sample the design can draw (all equally likely): the product of each stratum's subsets."""
    sizes, drawn = strata_sizes(length, rows)
    assert len(sizes) >= 3  # the whole head and at least two sampled strata
    starts = (torch.cumsum(sizes, 0) - sizes).tolist()
    per = [itertools.combinations(range(s, s + size), n) for s, size, n in zip(starts, sizes.tolist(), drawn.tolist())]
    return [torch.tensor(sum(parts, ())) for parts in itertools.product(*per)]


@pytest.mark.parametrize("causal,padded", [(True, False), (False, True), (True, True)])
def test_forward_totals_and_their_variance_estimates_are_unbiased_over_every_sample(causal, padded):
    """E[T̂] = T and E[V̂] = Var(T̂), exactly, over the 200 samples of 6 rows of 12 (row 0 whole,
    then strata of 5 and 6 rows drawing 2 and 3): the variance estimate is checked against the
    estimator's own spread."""
    length, rows = 12, 6
    q, k = _inputs(length, seed=6)
    key_mask = None
    if padded:
        key_mask = torch.ones(2, 1, 1, length, dtype=torch.bool)
        key_mask[1, ..., 9:] = False
    call = AttentionCall(q=q, k=k, v=None, scale=0.5, causal=causal, mask=key_mask)
    ok, vals = _per_row(q, k, 0.5, causal, key_mask, tau=0.9)
    designs = _designs(length, rows)
    assert len(designs) == 200
    fields = [forward_stats(call, {"actual": 0.5}, saturation=0.9, rows=pos) for pos in designs]
    for metric, field in (("entropy", "entropy"), ("max_prob", "max_prob"), ("saturation", "saturated")):
        totals = np.stack([f[f"{field}@actual"].numpy() for f in fields])
        variances = np.stack([f[f"{field}_var@actual"].numpy() for f in fields])
        exact = vals[metric].sum((0, 2)).numpy()
        np.testing.assert_allclose(totals.mean(0), exact, rtol=1e-5, atol=1e-6, err_msg=metric)
        np.testing.assert_allclose(variances.mean(0), totals.var(0), rtol=1e-3, atol=1e-9, err_msg=metric)


@pytest.mark.parametrize("causal,padded,kv_heads", [(True, False, 3), (False, True, 2)])
def test_backward_totals_and_their_variance_estimates_are_unbiased_over_every_sample(causal, padded, kv_heads):
    length, rows = 9, 5  # row 0 whole, then strata of 4 and 4 rows, 2 drawn in each: 36 samples
    call, dout, y = _case(length, causal, padded, kv_heads)
    exact = y.sum((0, 2)).numpy()
    designs = _designs(length, rows)
    fields = [grad_logits_stats(call, dout, {"actual": 0.5}, rows=pos) for pos in designs]
    totals = np.stack([f["grad_logits_sq@actual"].numpy() for f in fields])
    variances = np.stack([f["grad_logits_var@actual"].numpy() for f in fields])
    np.testing.assert_allclose(totals.mean(0), exact, rtol=1e-5)
    np.testing.assert_allclose(variances.mean(0), totals.var(0), rtol=1e-3)


def test_the_reported_standard_error_covers_the_exact_value():
    """Coverage in simulation: over 200 seeded draws of 32 of 256 causal rows, the exact mean lies
    within 1.96 reported standard errors about 95 % of the time, per head (the normal
    approximation: at least 88 %)."""
    length, rows, draws = 256, 32, 200
    q, k = _inputs(length, seed=7)
    call = AttentionCall(q=q, k=k, v=None, scale=0.4, causal=True)
    ok, vals = _per_row(q, k, 0.4, True)
    exact = (vals["entropy"].sum((0, 2)) / ok.sum((0, 2))).numpy()
    gen = torch.Generator().manual_seed(0)
    inside = np.zeros(3)
    for _ in range(draws):
        f = forward_stats(call, {"actual": 0.4}, rows=rows, generator=gen)
        est = (f["entropy@actual"] / f["rows"]).numpy()
        se = (f["entropy_var@actual"].clamp(min=0).sqrt() / f["rows"]).numpy()
        inside += np.abs(est - exact) <= 1.96 * se
    assert (inside / draws >= 0.88).all(), inside / draws


def test_stratification_removes_the_causal_trend_from_the_variance():
    """Early causal rows see few keys (high max_prob): a uniform sample's variance carries that
    trend, the stratified one only the spread within strata."""
    length, rows = 256, 32
    q, k = _inputs(length, seed=8)
    _, vals = _per_row(q, k, 0.4, True)
    y = vals["max_prob"].sum(0)  # (H, L): per-position batch sums
    uniform = y.var(-1, unbiased=True) * (length * length * (1 - rows / length) / rows)
    sizes, drawn = strata_sizes(length, rows)
    stratified = torch.zeros(y.shape[0], dtype=torch.float64)
    start = 0
    for size, n in zip(sizes.tolist(), drawn.tolist()):
        part = y[:, start : start + size]
        stratified += size * size * (1 - n / size) / n * part.var(-1, unbiased=True)
        start += size
    assert (stratified < 0.8 * uniform).all(), (stratified, uniform)


def test_nonfinite_stays_exact_when_rows_are_sampled():
    """A NaN logit in a row the sample skips is still counted, with the whole row's probabilities."""
    q, k = _inputs(64, seed=9)
    q = q.clone()
    q[0, 1, 5, 0] = math.nan
    call = AttentionCall(q=q, k=k, v=None, scale=0.3, causal=True)
    full = forward_stats(call, {"actual": 0.3})
    pos = sample_rows(64, 8, torch.Generator().manual_seed(0))
    assert 5 not in pos.tolist()
    sampled = forward_stats(call, {"actual": 0.3}, rows=pos)
    torch.testing.assert_close(sampled["nonfinite"], full["nonfinite"])
    assert full["nonfinite"][1].item() == 6 + 6  # 6 NaN logits (causal row 5), and its 6 probabilities


@pytest.mark.parametrize("length,rows", [(40, 12), (41, 13), (10, 1), (9, 8), (512, 128)])
def test_the_variance_estimate_is_cochrans_formula_stratum_by_stratum(length, rows):
    """The cached design constants give ``Σ_h L_h² (1 − n_h/L_h) / n_h · s_h²`` as written out per
    stratum in float64 (NaN for a stratum of one draw, 0 for one drawn whole)."""
    positions = sample_rows(length, rows, torch.Generator().manual_seed(rows))
    weight, stratum, sizes, drawn = design = row_design(positions, length)
    assert design is row_design(int(positions.shape[0]), length)  # one cached design per (L, N)
    y = torch.randn(3, positions.shape[0], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = torch.zeros(3, dtype=torch.float64)
    for h, (size, n) in enumerate(zip(sizes.tolist(), drawn.tolist())):
        part = y[:, stratum == h]
        if n == size:
            continue
        s2 = part.var(dim=1) if n > 1 else torch.full((3,), math.nan, dtype=torch.float64)
        want += size**2 * (1 - n / size) / n * s2
    got = stratified_variance(y, stratum, sizes, drawn)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(stratified_variance(y, *design[1:]), got, rtol=0, atol=0, equal_nan=True)  # cached terms
    # positions of no design (the last ones: the head stratum drawn short): one uniform sample, weight L/N
    odd = torch.arange(length - rows, length)
    if rows < length and rows > 2:
        w, s, L_h, n_h = row_design(odd, length)
        assert L_h.tolist() == [length] and n_h.tolist() == [rows] and torch.allclose(w, torch.full((rows,), length / rows, dtype=torch.float64))


def test_a_nonfinite_value_stays_in_its_stratum():
    """NaN or inf at a position of the head (a stratum drawn whole, variance 0) leaves the
    variance estimate finite; in a sampled stratum it makes it non-finite. Strata do not mix
    (a product with the design's 0/1 matrix would spread NaN·0 to every stratum)."""
    positions = sample_rows(64, 16, torch.Generator().manual_seed(0))
    design = row_design(positions, 64)
    y = torch.randn(3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    clean = stratified_variance(y, *design[1:])
    head = int(design[3][0])  # the first stratum: the head, drawn whole
    assert head == 4 and int(design[2][0]) == head
    y[0, 1], y[1, 1] = math.nan, math.inf  # inside the head
    y[2, head + 1] = math.nan  # in the first sampled stratum
    got = stratified_variance(y, *design[1:])
    torch.testing.assert_close(got[:2], clean[:2], rtol=0, atol=0)
    assert torch.isnan(got[2])


@pytest.mark.parametrize("length,rows", [(41, 13), (64, 16), (512, 128), (9, 8), (40, 12), (10, 1)])
def test_strata_of_two_draws_take_the_pairwise_variance(monkeypatch, length, rows):
    """The design's usual layout (strata drawn whole, then strata of two draws) computes each
    stratum's ``s_h²`` as ``(y_a − y_b)² / 2``: the same estimate as the general per-stratum
    formula, to float64 rounding; other layouts (a stratum of three or one) take the general one."""
    import probe.stats.sampling as sampling

    positions = sample_rows(length, rows, torch.Generator().manual_seed(rows))
    design = row_design(positions, length)
    y = torch.randn(5, positions.shape[0], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    fast = stratified_variance(y, *design[1:])
    pairs = sampling._variance_terms(*design[1:], y.device, y.dtype)[4]
    counts = design[3].tolist()
    assert (pairs is not None) == (rows < length and all(n == 2 for n in counts[1:]) and len(counts) > 1)
    sampling._TERMS.clear()
    monkeypatch.setattr(sampling, "_pairs", lambda *args: None)
    general = stratified_variance(y, *design[1:])
    sampling._TERMS.clear()
    torch.testing.assert_close(fast, general, rtol=1e-12, atol=0, equal_nan=True)
