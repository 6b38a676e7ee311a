"""finish_fields: calls reduced together (stacked on the head dimension) give each call's fields
exactly as alone, whatever mix of shapes, designs and scale groups the calls bring."""

from __future__ import annotations

import torch

from probe.call import AttentionCall
from probe.stats.forward import finish_fields, forward_fields, forward_rows
from probe.stats.plan import plan_call
from probe.stats.sampling import sample_rows


def _call(seed, b=2, h=4, hk=4, l=40, s=40, d=8, causal=False, padded=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, m, d, generator=g) for n, m in ((h, l), (hk, s), (hk, s)))
    mask = None
    if padded:
        mask = torch.ones(b, 1, 1, s, dtype=torch.bool)
        mask[-1, ..., s - s // 4 :] = False
    return AttentionCall(q=q, k=k, v=v, scale=d**-0.5, mask=mask, causal=causal)


def _planned(call, rows):
    positions = None if rows is None else sample_rows(call.q.shape[2], rows, torch.Generator().manual_seed(7))
    scales = {"actual": call.scale, "unscaled": 1.0, "standard": call.q.shape[-1] ** -0.5}
    return plan_call(call, scales, 64 * 2**20, positions)


def test_stacked_finishing_is_bitwise_each_calls_own():
    calls = [
        _call(0), _call(1), _call(2, padded=True),  # one shape: stacked
        _call(3, h=2, hk=2), _call(4, h=8, hk=2, causal=True),  # other head counts, GQA, causal
        _call(5, l=24, s=24), _call(6, l=40, s=40, d=16),  # another length; another d (another scale)
    ]
    for rows in (None, 12):
        alone, planned = [], []
        for call in calls:
            c, plan = _planned(call, rows)
            alone.append(forward_fields(c, plan))
            c, plan = _planned(call, rows)
            planned.append((forward_rows(c, plan), plan))
        together = finish_fields(planned)
        assert len(together) == len(calls)
        for mine, ref in zip(together, alone):
            assert mine.keys() == ref.keys()
            for name in ref:
                assert torch.equal(mine[name], ref[name]), name  # bitwise, NaN-free here


def test_a_call_with_nothing_to_measure_has_no_rows():
    call = _call(0, l=0)
    c, plan = _planned(call, None)
    assert forward_rows(c, plan) is None and forward_fields(c, plan) == {}
    assert finish_fields([]) == []
