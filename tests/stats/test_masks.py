"""Float masks read as boolean masks, Hugging Face's causal + padding mask as causal plus key
padding (probe.stats.masks): the same statistics as the general path, which reads the float
mask as a bias, and as float64 references; forward and backward; the verdict's cache."""

from __future__ import annotations

import gc
import itertools
import math

import numpy as np
import pytest
import torch

import probe
from probe.call import AttentionCall
from probe.stats import masks
from probe.stats.forward import forward_stats
from probe.stats.backward import grad_logits_stats
from probe.stats.sampling import row_design

SCALES = {"actual": 0.35, "unscaled": 1.0, "standard": 0.35}


def _valid(kind: str, b: int, l: int) -> torch.Tensor:
    """(B, 1, L, L) bool: which keys each query may attend to."""
    tril = torch.ones(l, l, dtype=torch.bool).tril()
    pad = torch.ones(b, 1, 1, l, dtype=torch.bool)
    pad[-1, ..., l - 3 :] = False  # the last batch row: its last 3 keys are padding
    if kind == "causal":
        return tril.expand(b, 1, l, l).clone()
    if kind == "causal+pad":
        return tril & pad
    if kind == "pad":
        return pad.expand(b, 1, l, l).clone()
    if kind == "window":  # sliding window of 3 keys: neither causal nor key padding
        i = torch.arange(l)
        return ((i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] < 3)).expand(b, 1, l, l).clone()
    raise ValueError(kind)


def _float_mask(valid: torch.Tensor, fill: float = torch.finfo(torch.float32).min) -> torch.Tensor:
    return torch.zeros(valid.shape).masked_fill(~valid, fill)


def _call(kind: str, l: int = 9, kv_heads: int = 2, seed: int = 0, fill: float = torch.finfo(torch.float32).min):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, l, 8, generator=gen) * 2
    k, v = (torch.randn(2, kv_heads, l, 8, generator=gen) for _ in range(2))
    valid = _valid(kind, 2, l)
    return AttentionCall(q=q, k=k, v=v, scale=0.35, bias=_float_mask(valid, fill)), valid


def _general(monkeypatch, fn, *args, **kwargs):
    """``fn`` with simplify disabled: the float mask is read as a bias (the general path)."""
    with monkeypatch.context() as m:
        m.setattr(masks, "simplify", lambda call, *a: call)
        m.setattr("probe.stats.plan.simplify", lambda call, *a: call)
        return fn(*args, **kwargs)


@pytest.mark.parametrize("kind,causal,keymask", [
    ("causal", True, False), ("causal+pad", True, True), ("pad", False, True), ("window", False, None),
])
def test_a_float_mask_becomes_boolean_and_causal_where_it_is(kind, causal, keymask):
    call, valid = _call(kind)
    out = masks.simplify(call)
    assert out.bias is None
    assert out.causal is causal
    if keymask is None:  # neither pattern: the whole boolean mask
        assert torch.equal(out.mask, valid)
    elif keymask:
        assert out.mask.shape == (2, 1, 1, 9)
        assert torch.equal(out.mask[..., 0, :], valid[..., -1, :])
    else:
        assert out.mask is None  # every key valid: no mask at all


@pytest.mark.parametrize("fill", [-math.inf, -1e4, -100.0])
def test_every_masking_value_is_a_mask(fill):
    call, _ = _call("causal+pad", fill=fill)
    out = masks.simplify(call)
    assert out.bias is None and out.causal


@pytest.mark.parametrize("edit", ["alibi", "nan", "inf", "small"])
def test_a_genuine_bias_is_left_as_it_is(edit):
    call, valid = _call("causal")
    bias = call.bias.clone()
    if edit == "alibi":
        bias = bias + torch.arange(9.0) * -0.25
    elif edit == "nan":
        bias[0, 0, 3, 1] = math.nan
    elif edit == "inf":
        bias[0, 0, 3, 1] = math.inf
    else:
        bias[0, 0, 3, 1] = -99.0  # above MASK_BIAS: a bias, not a mask
    call = AttentionCall(q=call.q, k=call.k, v=call.v, scale=0.35, bias=bias)
    assert masks.simplify(call) is call


@pytest.mark.parametrize("kind", ["causal", "causal+pad", "pad", "window"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_forward_statistics_equal_the_general_paths(monkeypatch, kind, kv_heads):
    call, _ = _call(kind, kv_heads=kv_heads)
    fast = forward_stats(call, SCALES)
    slow = _general(monkeypatch, forward_stats, call, SCALES)
    for name, value in slow.items():
        if name.startswith("logit@"):  # the general path stacks no min here; compare count, mean, M2
            np.testing.assert_allclose(fast[name][:3].numpy(), value[:3].numpy(), rtol=2e-5, atol=1e-9, err_msg=name)
        else:
            np.testing.assert_allclose(fast[name].numpy(), value.numpy(), rtol=2e-5, atol=1e-9, err_msg=name)


def _grads64(call: AttentionCall, valid: torch.Tensor, scale: float, dprobs: torch.Tensor) -> torch.Tensor:
    """Per (batch, head, row) ``Σ_j (∂L/∂Z)²`` in float64 from a given ``dP``."""
    g = call.q.shape[1] // call.k.shape[1]
    z = scale * call.q.double() @ call.k.double().repeat_interleave(g, 1).transpose(-1, -2)
    p = torch.softmax(torch.where(valid, z, -math.inf), -1).nan_to_num(0.0)
    dp = dprobs.double()
    return (p * (dp - (p * dp).sum(-1, keepdim=True))).square().sum(-1)


@pytest.mark.parametrize("kind", ["causal", "causal+pad", "window"])
def test_eager_backward_from_the_softmax_gradient(monkeypatch, kind):
    """An eager call's hooked ∂L/∂P takes the shifted backward; equal to the general path's and
    to float64, at every scale, and with sampled rows unbiased over every subset."""
    call, valid = _call(kind, l=6)
    dprobs = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(3)) * 1e3
    fast = grad_logits_stats(call, None, SCALES, grad_probs=dprobs)
    slow = _general(monkeypatch, grad_logits_stats, call, None, SCALES, grad_probs=dprobs)
    for name, value in slow.items():
        np.testing.assert_allclose(fast[name].numpy(), value.numpy(), rtol=1e-5, err_msg=name)
    for name, scale in SCALES.items():
        y = _grads64(call, valid, scale, dprobs)
        np.testing.assert_allclose(fast[f"grad_logits_sq@{name}"].numpy(), y.sum((0, 2)).numpy(), rtol=1e-5)
    # sampled rows: the Horvitz-Thompson estimate averages to the exact sum over every sample
    y = _grads64(call, valid, 0.35, dprobs)
    total, subsets = np.zeros(4), list(itertools.combinations(range(6), 2))
    for subset in subsets:
        rows = torch.tensor(subset)
        fields = grad_logits_stats(call, None, {"actual": 0.35}, grad_probs=dprobs, rows=rows)
        weight = row_design(rows, 6)[0]
        expected = (y[:, :, list(subset)] * weight).sum((0, 2))
        np.testing.assert_allclose(fields["grad_logits_sq@actual"].numpy(), expected.numpy(), rtol=1e-5)
        assert "grad_logits_var@actual" in fields
        total += fields["grad_logits_sq@actual"].numpy()
    np.testing.assert_allclose(total / len(subsets), y.sum((0, 2)).numpy(), rtol=1e-6)


def test_the_verdict_is_read_once_per_mask_and_forgotten_with_it(monkeypatch):
    calls = []
    real = masks.is_mask
    monkeypatch.setattr(masks, "is_mask", lambda bias: calls.append(1) or real(bias))
    call, _ = _call("causal+pad")
    for _ in range(4):  # four layers, one mask
        assert masks.simplify(call).causal
    assert len(calls) == 1
    call.bias.mul_(1.0)  # changed in place: read again
    masks.simplify(call)
    assert len(calls) == 2
    alias = call.bias.detach()  # another object over the same memory (as a front end may pass)
    masks.simplify(AttentionCall(q=call.q, k=call.k, v=call.v, scale=0.35, bias=alias))
    assert len(calls) == 2
    where = masks._where(call.bias)
    assert where in masks._CACHE
    other, _ = _call("pad")
    del call
    gc.collect()
    masks.simplify(other)
    assert where in masks._CACHE  # the alias still holds the memory
    del alias
    gc.collect()
    masks.simplify(other)  # the next call drops the verdicts of freed memory
    assert where not in masks._CACHE


def test_other_devices_are_left_alone():
    call, _ = _call("causal")
    meta = AttentionCall(q=call.q.to("meta"), k=call.k.to("meta"), v=call.v.to("meta"), scale=0.35,
                         bias=call.bias.to("meta"))
    assert masks.simplify(meta) is meta


def _llama_summary(attn, rows, padded):
    from tests.helpers import tiny_llama

    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    attention = torch.ones(2, 12, dtype=torch.long)
    if padded:
        attention[1, :3] = 0  # left padding
    model = tiny_llama(attn).train()
    with probe.watch(model, rows=rows) as p:
        model(input_ids=ids, attention_mask=attention).logits.square().mean().backward()
    return p.summary()


def _assert_same(a, b, rows, rtol):
    assert a.sites == b.sites
    for site in a.sites:
        for metric in ("logit_var", "logit_max", "entropy", "max_prob", "grad_logits"):
            for scale in ("actual", "unscaled"):
                np.testing.assert_allclose(a.value(site, metric, scale), b.value(site, metric, scale),
                                           rtol=rtol, err_msg=f"{site} {metric}@{scale}")
        if rows is not None:
            assert a.standard_error(site, "entropy") is not None
            assert a.standard_error(site, "grad_logits") is not None


@pytest.mark.parametrize("rows", [None, 4])
def test_eager_llama_reads_as_sdpa_llama(rows):
    """The same Hugging Face Llama, eager (a float mask, an explicit softmax, ∂L/∂P hooked) and
    SDPA (a boolean mask): the same values, estimates included (the same sampled positions).
    (With padding the two implementations differ themselves: eager's fully masked rows attend
    uniformly, so the gradients reaching attention differ; the next test covers padding.)"""
    _assert_same(_llama_summary("eager", rows, False), _llama_summary("sdpa", rows, False), rows, 1e-5)


@pytest.mark.parametrize("rows", [None, 4])
def test_eager_llama_with_padding_reads_as_its_general_path(monkeypatch, rows):
    fast = _llama_summary("eager", rows, True)
    slow = _general(monkeypatch, _llama_summary, "eager", None, True)  # the general path is exact
    if rows is None:
        _assert_same(fast, slow, rows, 1e-5)
    else:  # estimates from 4 of 12 rows, within a few of their standard errors of the exact values
        for site in fast.sites:
            for metric in ("entropy", "max_prob", "grad_logits"):
                err = np.abs(fast.value(site, metric) - slow.value(site, metric))
                assert np.all(err <= 4 * fast.standard_error(site, metric) + 1e-4 * np.abs(slow.value(site, metric)))


@pytest.mark.parametrize("kind", ["float causal+pad", "bool causal+pad", "float window"])
def test_reading_a_long_mask_stays_within_a_few_mib(kind):
    """L = S = 2048, batch 2: the model's float mask is 32 MiB, a boolean copy 8 MiB; reading its
    pattern takes blocks of rows (the whole-mask comparisons took several such copies at once).
    A float mask of neither pattern becomes a boolean one only within the budget."""
    from tests.faults.memory import PeakMemory

    l = 2048
    q = torch.randn(2, 2, l, 4)
    tril = torch.ones(l, l, dtype=torch.bool).tril()
    pad = torch.ones(2, 1, 1, l, dtype=torch.bool)
    pad[1, ..., :100] = False
    valid = tril & pad if "causal" in kind else _valid("window", 2, l)
    bias = _float_mask(valid) if kind.startswith("float") else None
    call = AttentionCall(q=q, k=q, v=q, scale=0.5, bias=bias, mask=None if bias is not None else valid)
    with PeakMemory() as mem:
        out = masks.simplify(call, budget_bytes=4 * 2**20)
    source = bias if bias is not None else valid  # the meter counts its storage once, at the first view
    assert mem.peak - source.untyped_storage().nbytes() <= 8 * 2**20, mem.peak
    if "causal" in kind:
        assert out.causal and out.bias is None and out.mask.shape == (2, 1, 1, l)
    else:  # 8 MiB as a boolean mask: over the 4 MiB budget, stays a bias (the general path)
        assert out is call
        assert masks.simplify(call, budget_bytes=16 * 2**20).mask.shape == (2, 1, l, l)


@pytest.mark.parametrize("keys", [24, 21])
def test_a_padding_pattern_is_recognized_word_by_word_or_not_at_all(keys):
    """Boolean rows that are whole 8-byte words are compared a word at a time: one key that
    differs in one row (any byte of a word) breaks the padding pattern, as it does for rows that
    are not whole words, offset views and transposed masks."""
    from probe.stats.masks import _same_rows

    mask = torch.ones(2, 1, 16, keys, dtype=torch.bool)
    mask[1, ..., keys - 5 :] = False
    views = [mask, mask[..., 1:], mask.transpose(-1, -2).contiguous().transpose(-1, -2)]
    for view in views:
        assert _same_rows(view, view[..., :1, :])
    for row, key in [(5, 0), (15, 7), (1, keys - 1), (9, 12)]:
        broken = mask.clone()
        broken[1, 0, row, key] = not bool(broken[1, 0, row, key])
        for view in (broken, broken[..., 0:], broken.transpose(-1, -2).contiguous().transpose(-1, -2)):
            assert not _same_rows(view, view[..., :1, :]), (row, key)
