"""Backward chunk lengths: at least BACKWARD_MIN_ROWS rows for wide calls, within the budget."""

from __future__ import annotations

import torch

from probe.call import AttentionCall
from probe.stats.chunks import cache_chunk_rows
from probe.stats.plan import _BACKWARD_BUFFERS, BACKWARD_MIN_ROWS, backward_step, plan_call


def _call(length, keys, heads=8):
    q = torch.randn(1, heads, length, 32)
    k = v = torch.randn(1, 2, keys, 32)
    return AttentionCall(q=q, k=k, v=v, scale=32**-0.5, causal=True)


def test_wide_calls_take_at_least_the_minimum_rows():
    call, plan = plan_call(_call(2048, 2048), {"actual": 32**-0.5})
    assert cache_chunk_rows(1, 8, 2048) < BACKWARD_MIN_ROWS  # a cache-sized chunk would be 32 rows
    assert backward_step(call, plan) == BACKWARD_MIN_ROWS


def test_the_budget_still_bounds_the_chunk():
    budget = 2**20  # 8 buffers of 8 heads x 1024 keys: 4 rows fit
    call, plan = plan_call(_call(1024, 1024), {"actual": 32**-0.5}, budget)
    step = backward_step(call, plan)
    assert step * 8 * 1024 * 4 * _BACKWARD_BUFFERS <= budget and step == 4


def test_never_more_rows_than_there_are():
    call, plan = plan_call(_call(20, 1024), {"actual": 32**-0.5})
    assert backward_step(call, plan) == 20
    call, plan = plan_call(_call(1024, 1024), {"actual": 32**-0.5}, rows=torch.tensor([3, 9, 500]))
    assert backward_step(call, plan) == 3


def test_grad_sq_is_the_softmax_gradient_norm_and_zero_on_a_fully_masked_row():
    """``rows.grad_sq`` (the shifted and general paths' backward): per row ``Σ_j (P_j (dP_j − c))²``
    with ``c = Σ P·dP`` from unnormalized exponentials, against float64; a fully masked row
    (``e = 0``, ``Σe = 0``) gives 0, a NaN in a row's ``dP`` makes that row NaN only."""
    import math

    from probe.stats.rows import grad_sq

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, 17, generator=g, dtype=torch.float64) * 3
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    e[1, 2, 4] = 0.0  # a fully masked row
    e[0, 0, 1, 9:] = 0.0  # a partly masked one
    dP = torch.randn(2, 3, 5, 17, generator=g, dtype=torch.float64)
    dP[0, 1, 3, 2] = math.nan
    p = e / e.sum(-1, keepdim=True)
    ref = (p * (dP - (p * dP).sum(-1, keepdim=True))).square().sum(-1)
    ref[1, 2, 4] = 0.0
    got = grad_sq(e.float(), dP.float(), e.float().sum(-1, keepdim=True), torch.empty(e.shape))
    assert got[1, 2, 4] == 0.0 and math.isnan(got[0, 1, 3]) and int(torch.isnan(got).sum()) == 1
    torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=0, equal_nan=True)
