"""The CPU fast paths of the shifted statistics agree with the exact path every device takes.

On CPUs, inputs proven to give finite logits (``inputs_finite``: ``max|q|·max|k|·d``) take the
centred path (probe.stats.paths.centred: rows centred in the product, moments from ``‖C‖²``, the mask
added as a finite ``NEG``, no non-finite count); otherwise a chunk proven finite by one sum
(``all_finite``) skips the count and is masked by adding 0 / -inf instead of ``masked_fill_``.
Every case below runs with the proofs and with both disabled. The ``all_finite`` shortcut must
give identical values; the centred path computes the same quantities in another order, so it
agrees to float32 rounding (and both agree with float64 references in test_moments.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from probe.call import AttentionCall
from probe.stats import plan
from probe.stats.backward import grad_logits_stats
from probe.stats.forward import forward_stats
from probe.stats.paths import shifted


def _call(case: str, poison: str) -> AttentionCall:
    g = torch.Generator().manual_seed(3)
    b, h, hk, l, d = 2, 4, 2, 40, 8
    q, k, v = (torch.randn(b, n, l, d, generator=g) for n in (h, hk, hk))
    mask = None
    if case in ("mask", "causal+mask"):
        mask = torch.ones(b, 1, l, l, dtype=torch.bool)
        mask[1, ..., 30:] = False  # the second row's last 10 keys are padding
    if poison == "masked nan":  # a padded key that is NaN: masked, so invisible
        k[1, 0, 35] = math.nan
    elif poison == "valid nan":
        q[0, 1, 5, 2] = math.nan
    elif poison == "valid inf":  # q = (inf, 0, ...): logits ±inf by the sign of k[..., 0]
        q[0, 2, 12] = 0.0
        q[0, 2, 12, 0] = math.inf
    return AttentionCall(q=q, k=k, v=v, scale=d**-0.5, mask=mask, causal=case.startswith("causal"))


def _both(monkeypatch, fn, centred=True):
    with monkeypatch.context() as m:
        if not centred:  # the all_finite shortcut alone
            m.setattr(plan, "inputs_finite", lambda call: False)
        fast = fn()
    with monkeypatch.context() as m:
        m.setattr(shifted, "all_finite", lambda x: False)
        m.setattr(plan, "inputs_finite", lambda call: False)
        exact = fn()
    return fast, exact


def _close(a, b, key, exact):
    if exact:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=key)
    else:  # another order of float32 operations
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-5, equal_nan=True, msg=key)


@pytest.mark.parametrize("centred", [True, False])
@pytest.mark.parametrize("poison", ["none", "masked nan", "valid nan", "valid inf"])
@pytest.mark.parametrize("case", ["none", "mask", "causal", "causal+mask"])
def test_fast_path_gives_the_exact_paths_values(monkeypatch, case, poison, centred):
    if poison == "masked nan" and "mask" not in case:
        pytest.skip("needs a mask")
    call = _call(case, poison)
    scales = {"actual": call.scale, "unscaled": 1.0}
    budget = 8 * call.q.shape[0] * call.q.shape[1] * call.q.shape[2] * 4  # several chunks
    fast, exact = _both(monkeypatch, lambda: forward_stats(call, scales, budget_bytes=budget), centred)
    assert fast.keys() == exact.keys()
    # non-finite inputs are never proven finite: the centred path does not run
    same = not centred or poison in ("masked nan", "valid nan", "valid inf")
    for key in fast:
        _close(fast[key], exact[key], key, same)
    if poison in ("none", "masked nan"):
        assert float(fast["nonfinite"].sum()) == 0
        assert all(torch.isfinite(t).all() for t in fast.values())
    else:
        assert float(fast["nonfinite"].sum()) > 0
    dout = torch.randn(*call.q.shape[:3], call.v.shape[-1], generator=torch.Generator().manual_seed(4))
    fast, exact = _both(monkeypatch, lambda: grad_logits_stats(call, dout, scales, budget))
    for key in fast:  # the backward has no centred path
        torch.testing.assert_close(fast[key], exact[key], rtol=0, atol=0, equal_nan=True, msg=key)


def test_a_masked_nan_key_changes_nothing():
    poisoned = _call("mask", "masked nan")
    clean = _call("mask", "none")
    scales = {"actual": clean.scale}
    a, b = forward_stats(poisoned, scales), forward_stats(clean, scales)
    for key in a:  # the poisoned call is not proven finite: the exact path vs the centred one
        torch.testing.assert_close(a[key], b[key], rtol=2e-5, atol=1e-5, msg=key)


@pytest.mark.parametrize("scale", [2.0**-3, 2.0**35, 2.0**40, 2.0**48])
def test_the_centred_path_counts_a_softmax_that_overflows(monkeypatch, scale):
    # logits near 2^84 are proven finite (the centred path runs) but σ·r overflows float32 at
    # σ = 2^48: every such row's softmax is non-finite, and the centred path must count it as
    # the exact path does (below σ = 2^36 no proven logit can overflow: the check is skipped)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 24, 8, generator=g) * 2.0**41
    k = torch.randn(1, 2, 24, 8, generator=g) * 2.0**41
    call = AttentionCall(q, k, None, scale)
    scales = {"actual": scale}
    assert plan.inputs_finite(call)
    fast, exact = _both(monkeypatch, lambda: forward_stats(call, scales), True)
    z = (q.double() @ k.double().transpose(-1, -2)).float() * scale  # the model's float32 logits
    overflowing = (~torch.isfinite(z.amax(-1))).sum((0, 2)) * 24  # n per row whose max overflows
    torch.testing.assert_close(fast["nonfinite"], exact["nonfinite"], rtol=0, atol=0)
    torch.testing.assert_close(fast["nonfinite"], overflowing.to(fast["nonfinite"].dtype), rtol=0, atol=0)
    assert (float(fast["nonfinite"].sum()) > 0) == (scale >= 2.0**48)
