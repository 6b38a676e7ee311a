"""probe.stats.max_logit against a plain float64 reference: every layout, mask and scale."""

from __future__ import annotations

import math

import pytest
import torch

from probe.call import AttentionCall
from probe.stats.forward import forward_stats
from probe.stats.max_logit import max_logit


def _reference(q, k, scale, valid):
    """max over valid (b, i, j) of scale_h · q_i·k_j, per head, float64, one loop per head."""
    q64, k64 = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    heads = q.shape[1]
    s = scale.double().reshape(-1).expand(heads) if isinstance(scale, torch.Tensor) else torch.full((heads,), float(scale), dtype=torch.float64)
    out = torch.full((heads,), -math.inf, dtype=torch.float64)
    for h in range(heads):
        z = s[h] * (q64[:, h] @ k64[:, h].transpose(-1, -2))
        v = valid.expand(q.shape[0], heads, q.shape[2], k.shape[2])[:, h]
        if v.any():
            out[h] = z[v].max()
    return out


def _qk(b=2, h=4, hk=None, l=9, s=None, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hk = hk or h
    s = s or l
    q = (3 * torch.randn(b, h, l, d, generator=g)).to(dtype)
    k = (3 * torch.randn(b, hk, s, d, generator=g)).to(dtype)
    return q, k


def _check(call, valid, scale=None, budget=64 * 2**20, rtol=1e-5):
    got = max_logit(call, budget)
    want = _reference(call.q, call.k, call.scale if scale is None else scale, valid)
    assert got.dtype == torch.float32 and got.shape == (call.heads,)
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("hk", [4, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_plain_gqa_causal(hk, causal):
    q, k = _qk(hk=hk, l=9, s=11 if not causal else 9)
    call = AttentionCall(q, k, None, scale=0.35, causal=causal)
    valid = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    if causal:
        valid = valid.tril()
    _check(call, valid)


def test_small_chunks_match_one_chunk():
    # a budget of a few rows per chunk: the running max over chunks, causal trimming per chunk
    q, k = _qk(b=1, h=2, l=40, d=4)
    call = AttentionCall(q, k, None, scale=0.5, causal=True)
    valid = torch.ones(40, 40, dtype=torch.bool).tril()
    _check(call, valid, budget=2 * 40 * 4 * 3)


def test_boolean_mask_and_bias_mask():
    q, k = _qk(b=2, h=3, l=6, s=7)
    mask = torch.rand(2, 1, 6, 7, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[..., 0] = True
    _check(AttentionCall(q, k, None, scale=0.2, mask=mask), mask)
    # an additive bias: entries at or below -100 mask, the others do not enter the max logit
    bias = torch.where(mask, torch.randn(2, 1, 6, 7) * 5, torch.tensor(torch.finfo(torch.float32).min))
    _check(AttentionCall(q, k, None, scale=0.2, bias=bias), mask)


def test_row_without_valid_key_and_head_without_any():
    q, k = _qk(b=1, h=2, l=3, s=4)
    mask = torch.ones(1, 2, 3, 4, dtype=torch.bool)
    mask[0, 0, 1] = False  # one row of head 0 attends nothing
    mask[0, 1] = False  # head 1 attends nothing at all
    got = max_logit(AttentionCall(q, k, None, scale=1.0, mask=mask))
    assert got[1] == -math.inf
    torch.testing.assert_close(got[:1].double(), _reference(q, k, 1.0, mask)[:1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", [-0.3, torch.tensor([0.5, -1.0, 0.0, 2.0])])
def test_negative_and_per_head_scales(scale):
    q, k = _qk(h=4)
    call = AttentionCall(q, k, None, scale=scale, causal=True)
    _check(call, torch.ones(9, 9, dtype=torch.bool).tril())


def test_softcap_is_ignored_as_in_logit_max():
    # QK-Clip caps σ·q·kᵀ, the part the weights make: before the soft cap
    q, k = _qk()
    capped = AttentionCall(q, k, None, scale=0.5, softcap=5.0)
    _check(capped, torch.ones(9, 9, dtype=torch.bool))


def test_nan_propagates_to_its_head_only_and_masked_nan_does_not():
    q, k = _qk(b=1, h=2, l=4)
    q[0, 0, 2, 0] = float("nan")
    got = max_logit(AttentionCall(q, k, None, scale=1.0))
    assert math.isnan(got[0]) and math.isfinite(got[1])
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    mask[..., 2, :] = False  # the NaN row is masked: it does not count
    got = max_logit(AttentionCall(q, k, None, scale=1.0, mask=mask))
    assert torch.isfinite(got).all()


def test_half_precision_inputs_reduce_in_float32():
    q, k = _qk(dtype=torch.bfloat16)
    _check(AttentionCall(q, k, None, scale=0.25), torch.ones(9, 9, dtype=torch.bool), rtol=1e-5)


@pytest.mark.parametrize("case", ["plain", "causal_gqa", "bias", "per_head"])
def test_same_as_logit_max_of_the_full_statistics(case):
    q, k = _qk(hk=2 if case == "causal_gqa" else 4)
    kw = {"plain": {}, "causal_gqa": {"causal": True}, "bias": {"bias": torch.randn(1, 1, 9, 9)},
          "per_head": {"scale": torch.tensor([0.1, 0.2, 0.3, 0.4])}}[case]
    call = AttentionCall(q, k, None, **{"scale": 0.3, **kw})
    full = forward_stats(call, {"actual": call.scale})["logit_max@actual"]
    torch.testing.assert_close(max_logit(call), full.float(), rtol=1e-6, atol=1e-6)


def test_meta_tensors_need_no_data():
    q = torch.empty(2, 4, 16, 8, device="meta")
    out = max_logit(AttentionCall(q, q, None, scale=0.5, causal=True))
    assert out.shape == (4,) and out.device.type == "meta"


def test_unknown_scale_is_an_error():
    q, k = _qk()
    with pytest.raises(ValueError, match="scale"):
        max_logit(AttentionCall(q, k, None, scale=None))
