"""Calls on the shifted path (CPUs; inputs not proven finite, or a mask of another pattern) whose
float32 row sums of squared logits overflow are measured again rescaled, as the centred and
general paths' are (``probe.stats.forward._rescaled_rows``): q and k times 2^-32, the scales times
2^64, the same σR. The retry runs when ``max|q|·max|k|·d·sqrt(S) ≤ 2^126`` (then it is finite);
beyond, R itself leaves float32's range and ``logit_var`` keeps its inf (docs/guarantees.md)."""

from __future__ import annotations

import math

import pytest
import torch

import probe.stats.forward as forward
from probe.call import AttentionCall
from probe.stats import plan
from probe.stats.forward import forward_stats


def _retries(monkeypatch):
    again = []
    real = forward._rescaled_rows
    monkeypatch.setattr(forward, "_rescaled_rows", lambda *a: again.append(1) or real(*a))
    return again


def _inputs(size, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 40, 8, generator=g) * size
    k = torch.randn(2, 2, 40, 8, generator=g) * size
    return q, k


def _reference(q, k, sigma, valid):
    r = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * sigma
    z = r.masked_fill(~valid, -math.inf)
    p = torch.softmax(z, -1).nan_to_num(0.0)
    n = valid.sum(-1)
    ent = -(torch.where(p > 0, p * torch.log(p), 0.0)).sum(-1) / torch.log(n.clamp(min=2).double())
    heads = [(r[:, h][valid[:, h]].var(unbiased=False).item(), r[:, h][valid[:, h]].max().item()) for h in range(4)]
    return torch.tensor(heads, dtype=torch.float64), torch.where(n >= 2, ent, 0.0).sum((0, 2))


@pytest.mark.parametrize("mask_kind", ["none", "pattern"])
def test_shifted_calls_whose_squares_overflow_are_measured_again(monkeypatch, mask_kind):
    """Raw logits near 1e29 (past the centred paths' 2^90 proof: the shifted path) at a scale of
    1e-28, an ordinary softmax; with no mask, and with a mask of no key-padding pattern."""
    again = _retries(monkeypatch)
    q, k = _inputs(1e14)
    valid = torch.ones(2, 4, 40, 40, dtype=torch.bool)
    mask = None
    if mask_kind == "pattern":
        g = torch.Generator().manual_seed(9)
        mask = torch.rand(2, 4, 40, 40, generator=g) > 0.3
        mask[..., 0] = True  # every row keeps a key
        valid = mask
    sigma = 1e-28
    call = AttentionCall(q=q, k=k, v=None, scale=sigma, mask=mask)
    _, p = plan.plan_call(call, {"actual": sigma}, 2**14)
    assert p.path == "shifted"
    got = forward_stats(call, {"actual": sigma}, budget_bytes=2**14)
    assert again
    heads, entropy = _reference(q, k, sigma, valid)
    n, _, m2 = got["logit@actual"].double()
    torch.testing.assert_close(m2 / n, heads[:, 0], rtol=1e-5, atol=0)
    torch.testing.assert_close(got["logit_max@actual"].double(), heads[:, 1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["entropy@actual"].double(), entropy, rtol=1e-4, atol=1e-4)
    assert float(got["nonfinite"].sum()) == 0


def test_ordinary_shifted_calls_are_not_measured_again(monkeypatch):
    again = _retries(monkeypatch)
    q, k = _inputs(1.0)
    mask = torch.rand(2, 4, 40, 40, generator=torch.Generator().manual_seed(2)) > 0.3
    got = forward_stats(AttentionCall(q=q, k=k, v=None, scale=0.35, mask=mask), {"actual": 0.35})
    assert not again and torch.isfinite(got["logit@actual"]).all()


def test_logits_past_float32_keep_their_inf_and_are_not_retried(monkeypatch):
    """q, k near 1e20: R near 1e40 is past float32 before any retry, and 2^64 times smaller its
    squares would still overflow; the bound says so and the inf stands (the documented limit)."""
    again = _retries(monkeypatch)
    q, k = _inputs(1e20)
    got = forward_stats(AttentionCall(q=q, k=k, v=None, scale=1e-40), {"actual": 1e-40})
    assert not again
    assert not torch.isfinite(got["logit@actual"][2]).all()


def test_non_finite_inputs_are_not_retried(monkeypatch):
    again = _retries(monkeypatch)
    q, k = _inputs(1.0)
    q[0, 1, 3, 2] = math.inf
    got = forward_stats(AttentionCall(q=q, k=k, v=None, scale=0.35), {"actual": 0.35})
    assert not again and float(got["nonfinite"].sum()) > 0
