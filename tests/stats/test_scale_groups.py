"""Scales that are equal in float32, the precision the chunks are computed in, share one pass."""

from __future__ import annotations

import math

import torch

from probe.call import AttentionCall
from probe.stats.backward import grad_logits_stats
from probe.stats.forward import forward_stats
from probe.stats.plan import group_scales


def test_hugging_faces_scale_and_the_standard_one_share_a_group():
    # transformers writes head_dim ** -0.5: one ulp away from 1 / sqrt(head_dim) at 32
    actual, standard = 32**-0.5, 1 / math.sqrt(32)
    assert actual != standard
    names, values = group_scales({"actual": actual, "unscaled": 1.0, "standard": standard})
    assert names == (("actual", "standard"), ("unscaled",)) and values == (actual, 1.0)


def test_scales_float32_cannot_hold_or_tell_apart_stay_apart():
    for a, b in [(1e300, 1e301), (math.inf, 1e301), (1.0, 1.0 + 2**-20)]:
        names, _ = group_scales({"actual": a, "other": b})
        assert names == (("actual",), ("other",)), (a, b)
    nan = float("nan")
    assert group_scales({"actual": nan, "other": float("nan")})[0] == (("actual",), ("other",))
    tensor = torch.tensor([0.5, 0.25])  # per-head scales group by identity
    assert group_scales({"actual": tensor, "other": tensor.clone()})[0] == (("actual",), ("other",))


def test_a_shared_pass_reports_what_separate_passes_report():
    """standard at 1/sqrt(32) reports, to float32 rounding, what it reports computed on its own
    (a third scale apart from actual's group), forward and backward."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 24, 32, generator=g) for _ in range(3))
    call = AttentionCall(q=q, k=k, v=v, scale=32**-0.5, causal=True)
    dout = torch.randn(1, 4, 24, 32, generator=g)
    shared = {"actual": 32**-0.5, "unscaled": 1.0, "standard": 1 / math.sqrt(32)}
    alone = {"actual": 32**-0.5, "unscaled": 1.0, "standard": 1 / math.sqrt(32) * (1 + 2**-20)}
    for run in (lambda s: forward_stats(call, s), lambda s: grad_logits_stats(call, dout, s)):
        a, b = run(shared), run(alone)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-7, msg=key)
