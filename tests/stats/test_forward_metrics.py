"""Every forward metric at every scale against the plain float64 reference in tests/helpers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import probe
from probe.call import AttentionCall
from probe.stats.forward import forward_stats
from tests.helpers import OneCall, reference_metrics


def _inputs(b=2, h=4, hk=None, l=7, s=None, d=16, dtype=torch.float32):
    hk = hk or h
    s = s or l
    return (torch.randn(b, h, l, d, dtype=dtype), torch.randn(b, hk, s, d, dtype=dtype),
            torch.randn(b, hk, s, d, dtype=dtype))


def _full_valid(b, h, l, s, mask=None, bias=None, causal=False):
    valid = torch.ones(b, h, l, s, dtype=torch.bool)
    if causal:
        valid &= torch.ones(l, s, dtype=torch.bool).tril()
    if mask is not None:
        valid &= mask.expand(b, h, l, s)
    if bias is not None:
        valid &= (bias > torch.finfo(bias.dtype).min / 2).expand(b, h, l, s)
    return valid


def _check(p_summary, q, k, valid, bias=None, scales=None, rtol=2e-4, atol=2e-5):
    site = p_summary.sites[0]
    scales = scales or {}
    for name, sigma in scales.items():
        ref = reference_metrics(q, k, sigma, valid, bias)
        for metric in ("logit_var", "logit_max", "entropy", "max_prob", "saturation"):
            got = p_summary.value(site, metric, name)
            np.testing.assert_allclose(got, ref[metric], rtol=rtol, atol=atol, err_msg=f"{metric}@{name}")
        assert p_summary.value(site, "nonfinite").sum() == 0


def _run(module, **kw):
    with probe.watch(module, **kw) as p:
        module()
    return p.summary()


CASES = {
    "no_mask": dict(),
    "causal": dict(is_causal=True),
    "explicit_scale": dict(scale=0.3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_basic_cases_match_reference(case):
    q, k, v = _inputs()
    kwargs = CASES[case]
    s = _run(OneCall(q, k, v, **kwargs), scales={"half": lambda d: 0.5 / math.sqrt(d)})
    valid = _full_valid(2, 4, 7, 7, causal=kwargs.get("is_causal", False))
    actual = kwargs.get("scale", 1 / math.sqrt(16))
    _check(s, q, k, valid, scales={"actual": actual, "unscaled": 1.0, "standard": 0.25, "half": 0.125})


@pytest.mark.parametrize("l,s", [(3, 8), (8, 3)])
def test_causal_cross_attention_is_top_left_aligned(l, s):
    q, k, v = _inputs(l=l, s=s)
    summary = _run(OneCall(q, k, v, is_causal=True))
    valid = _full_valid(2, 4, l, s, causal=True)
    _check(summary, q, k, valid, scales={"actual": 0.25, "unscaled": 1.0})


def test_boolean_padding_mask():
    q, k, v = _inputs(l=6)
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    mask[0, ..., 4:] = False  # batch 0 has two padded keys
    mask[1, ..., 1:] = False  # batch 1: one valid key per row -> no softmax rows
    s = _run(OneCall(q, k, v, attn_mask=mask))
    _check(s, q, k, _full_valid(2, 4, 6, 6, mask=mask), scales={"actual": 0.25, "unscaled": 1.0, "standard": 0.25})
    # the rows of batch 1 do not count: entropy averages batch 0's rows only
    assert np.isfinite(s.value(s.sites[0], "entropy")).all()


def test_hf_style_float_mask_with_finfo_min_and_bias():
    q, k, v = _inputs(l=5, s=9)
    bias = torch.randn(2, 1, 5, 9) * 0.5
    bias[0, :, :, 6:] = torch.finfo(torch.float32).min  # padding, Hugging Face style
    bias[1, :, 2, :] = float("-inf")  # a fully masked row
    s = _run(OneCall(q, k, v, attn_mask=bias))
    valid = _full_valid(2, 4, 5, 9, bias=bias)
    _check(s, q, k, valid, bias=torch.where(valid, bias, 0.0), scales={"actual": 0.25, "unscaled": 1.0})
    for metric in s.metrics(s.sites[0]):
        for scale in s.scales(s.sites[0], metric):
            assert np.isfinite(s.value(s.sites[0], metric, scale)).all(), (metric, scale)


def test_fully_masked_rows_do_not_leak_nan():
    q, k, v = _inputs(l=4)
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[1] = False  # query row 1 sees nothing
    mask[2, 1:] = False  # query row 2 sees one key
    s = _run(OneCall(q, k, v, attn_mask=mask))
    _check(s, q, k, _full_valid(2, 4, 4, 4, mask=mask), scales={"actual": 0.25, "unscaled": 1.0})


def test_gqa():
    q, k, v = _inputs(h=8, hk=2, l=6)
    s = _run(OneCall(q, k, v, enable_gqa=True, is_causal=True))
    site = s.sites[0]
    assert s.info(site)["heads"] == 8 and s.info(site)["kv_heads"] == 2
    _check(s, q, k, _full_valid(2, 8, 6, 6, causal=True), scales={"actual": 0.25, "unscaled": 1.0})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_reduce_in_float32(dtype):
    q, k, v = _inputs(dtype=dtype)
    s = _run(OneCall(q, k, v, is_causal=True))
    valid = _full_valid(2, 4, 7, 7, causal=True)
    # the reference sees the same half-precision values, upcast
    _check(s, q, k, valid, scales={"actual": 0.25, "unscaled": 1.0}, rtol=1e-3, atol=1e-4)


def test_dropout_does_not_change_statistics():
    q, k, v = _inputs()
    a = _run(OneCall(q, k, v, dropout_p=0.5))
    b = _run(OneCall(q, k, v))
    for metric in ("entropy", "max_prob", "logit_var"):
        np.testing.assert_array_equal(a.value(a.sites[0], metric), b.value(b.sites[0], metric))


def test_chunking_gives_the_same_result_as_one_chunk():
    q, k, _ = _inputs(l=33, s=20)
    call = AttentionCall(q=q, k=k, v=None, scale=0.25, causal=True)
    scales = {"actual": 0.25, "unscaled": 1.0}
    whole = forward_stats(call, scales, budget_bytes=2**30)
    rowwise = forward_stats(call, scales, budget_bytes=1)  # one query row per chunk
    for field in whole:
        torch.testing.assert_close(rowwise[field], whole[field], rtol=1e-5, atol=1e-5)


def test_per_head_scale_tensor():
    q, k, _ = _inputs()
    sigma = torch.tensor([0.1, 0.2, 0.3, -0.4])
    call = AttentionCall(q=q, k=k, v=None, scale=sigma)
    fields = forward_stats(call, {"actual": sigma})
    valid = _full_valid(2, 4, 7, 7)
    for h in range(4):
        ref = reference_metrics(q[:, h : h + 1], k[:, h : h + 1], float(sigma[h]), valid[:, h : h + 1])
        n, mean, m2 = fields["logit@actual"][:, h].double()
        assert float(m2 / n) == pytest.approx(ref["logit_var"][0], rel=1e-4)
        assert float(fields["logit_max@actual"][h]) == pytest.approx(ref["logit_max"][0], rel=1e-4)


def test_nonfinite_counted():
    q, k, v = _inputs()
    q = q.clone()
    q[0, 1, 3, 0] = float("nan")
    s = _run(OneCall(q, k, v))
    nf = s.value(s.sites[0], "nonfinite")
    # head 1: 7 NaN logits in row 3 of batch 0, and that row's 7 probabilities
    assert nf.tolist() == [0, 14, 0, 0]


def test_softcap_matches_reference():
    q, k, _ = _inputs()
    call = AttentionCall(q=q, k=k, v=None, scale=1.0, softcap=5.0)
    fields = forward_stats(call, {"actual": 1.0})
    ref = reference_metrics(q, k, 1.0, _full_valid(2, 4, 7, 7), softcap=5.0)
    rows = fields["rows"].double()
    np.testing.assert_allclose((fields["entropy@actual"] / rows).numpy(), ref["entropy"], rtol=1e-4)
    # logit_max is of sigma*R before the cap
    np.testing.assert_allclose(fields["logit_max@actual"].numpy(), ref["logit_max"], rtol=1e-5)


def test_theory_unit_variance_dk_256():
    """The seed's theory: Var(q·k) = d_k for unit-variance q, k; the divisor brings it to 1."""
    torch.manual_seed(1)
    q, k, v = _inputs(b=4, h=2, l=64, d=256)
    s = _run(OneCall(q, k, v))
    site = s.sites[0]
    assert s.value(site, "logit_var", "unscaled") == pytest.approx(np.full(2, 256.0), rel=0.15)
    assert s.value(site, "logit_var", "standard") == pytest.approx(np.ones(2), rel=0.15)
    assert (s.value(site, "saturation", "unscaled") > 0.3).all()  # ~0.46 with 64 keys
    assert (s.value(site, "saturation", "standard") < 0.05).all()
    assert (s.value(site, "entropy", "unscaled") < s.value(site, "entropy", "standard") - 0.3).all()


def test_reductions_run_on_meta_tensors():
    """No .item(), no data-dependent shapes: the whole forward reduction runs on meta."""
    q = torch.empty(2, 8, 300, 64, device="meta")
    k = torch.empty(2, 2, 300, 64, device="meta")
    bias = torch.empty(2, 1, 300, 300, device="meta")
    mask = torch.empty(2, 1, 1, 300, dtype=torch.bool, device="meta")
    call = AttentionCall(q=q, k=k, v=None, scale=0.125, bias=bias, mask=mask, causal=True, softcap=30.0)
    fields = forward_stats(call, {"actual": 0.125, "unscaled": 1.0, "x": torch.ones(8, device="meta")},
                           budget_bytes=2**20)
    assert all(t.device.type == "meta" for t in fields.values())
    assert fields["entropy@unscaled"].shape == (8,)
