"""The CPU fast paths of the shifted statistics (probe.stats.shifted) change no value.

On CPUs a chunk proven finite by one sum (``all_finite``) skips the non-finite count and is
masked by adding 0 / -inf instead of ``masked_fill_``. Every case below is run with the proof
and with it disabled (the exact path every device takes); the results must be identical, with
non-finite logits in valid and in masked entries.
"""

from __future__ import annotations

import math

import pytest
import torch

from probe.call import AttentionCall
from probe.stats import shifted
from probe.stats.functional import forward_stats
from probe.stats.grads import grad_logits_stats


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


def _both(monkeypatch, fn):
    fast = fn()
    with monkeypatch.context() as m:
        m.setattr(shifted, "all_finite", lambda x: False)
        exact = fn()
    return fast, exact


@pytest.mark.parametrize("poison", ["none", "masked nan", "valid nan", "valid inf"])
@pytest.mark.parametrize("case", ["none", "mask", "causal", "causal+mask"])
def test_fast_path_gives_the_exact_paths_values(monkeypatch, case, poison):
    if poison == "masked nan" and "mask" not in case:
        pytest.skip("needs a mask")
    call = _call(case, poison)
    scales = {"actual": call.scale, "unscaled": 1.0}
    budget = 8 * call.q.shape[0] * call.q.shape[1] * call.q.shape[2] * 4  # several chunks
    fast, exact = _both(monkeypatch, lambda: forward_stats(call, scales, budget_bytes=budget))
    assert fast.keys() == exact.keys()
    for key in fast:
        torch.testing.assert_close(fast[key], exact[key], rtol=0, atol=0, equal_nan=True, msg=key)
    if poison in ("none", "masked nan"):
        assert float(fast["nonfinite"].sum()) == 0
        assert all(torch.isfinite(t).all() for t in fast.values())
    else:
        assert float(fast["nonfinite"].sum()) > 0
    dout = torch.randn(*call.q.shape[:3], call.v.shape[-1], generator=torch.Generator().manual_seed(4))
    fast, exact = _both(monkeypatch, lambda: grad_logits_stats(call, dout, scales, budget))
    for key in fast:
        torch.testing.assert_close(fast[key], exact[key], rtol=0, atol=0, equal_nan=True, msg=key)


def test_a_masked_nan_key_changes_nothing():
    poisoned = _call("mask", "masked nan")
    clean = _call("mask", "none")
    scales = {"actual": clean.scale}
    a, b = forward_stats(poisoned, scales), forward_stats(clean, scales)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
