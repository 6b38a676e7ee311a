"""A large transposed float32 k or v is read in place, not copied (probe.stats.chunks.kv_view).

Hugging Face's k and v are transposed views of ``(B, S, H_kv, d)`` projections; a batched product
would copy them on every chunk, so the paths that multiply by all of k (the exact fallback, the
general path, the backward) made one contiguous copy per call: ``B·H_kv·S·d`` floats, 32 MiB for
8 heads of 64 at S = 16384, per tensor. Above ``_KV_COPY_BYTES`` the products now go one ``mm``
per batch and kv head instead. Here the threshold is 0, so that small calls take that route, and
every value must equal the copying route's (the same products, summed in the same order per row).
"""

from __future__ import annotations

import pytest
import torch

from probe.call import AttentionCall
from probe.stats import chunks
from probe.stats.forward import forward_stats
from probe.stats.backward import grad_logits_stats
from tests.faults.memory import PeakMemory

SCALES = {"actual": 0.25, "unscaled": 1.0}


def _hf_call(heads: int, kv: int, causal: bool, bias: bool, row_mask: bool, seed: int = 0) -> AttentionCall:
    g = torch.Generator().manual_seed(seed)
    b, length, d = 2, 48, 16
    q = torch.randn(b, length, heads, d, generator=g).transpose(1, 2)
    kv_proj = torch.randn(b, length, 2 * kv, d, generator=g).transpose(1, 2)  # one fused projection
    k, v = kv_proj.chunk(2, dim=1)
    mask = None
    if row_mask:  # a sliding window: depends on the row, so the exact fallback path runs
        i = torch.arange(length)
        mask = ((i[:, None] - i[None, :]).abs() < 9).expand(b, 1, length, length)
    alibi = -0.1 * torch.arange(length, dtype=torch.float32).expand(b, heads, 1, length) if bias else None
    return AttentionCall(q=q, k=k, v=v, scale=0.25, causal=causal, mask=mask, bias=alibi)


def test_which_tensors_are_read_in_place(monkeypatch):
    monkeypatch.setattr(chunks, "_KV_COPY_BYTES", 0)
    call = _hf_call(4, 2, False, False, False)
    assert chunks.kv_view(call.k)[1] is True  # transposed float32: left in place
    assert chunks.kv_view(call.k.contiguous())[1] is False  # already contiguous: a view anyway
    assert chunks.kv_view(call.k.to(torch.bfloat16))[1] is False  # converted: one float32 copy
    monkeypatch.setattr(chunks, "_KV_COPY_BYTES", 16 * 2**20)
    assert chunks.kv_view(call.k)[1] is False  # small: one copy per call, batched products


@pytest.mark.parametrize("heads,kv", [(4, 4), (4, 2)])
@pytest.mark.parametrize("causal,bias,row_mask", [(True, False, True), (False, True, False), (True, True, False)],
                         ids=["sliding-window", "alibi", "alibi-causal"])
def test_in_place_products_give_the_copying_values(monkeypatch, heads, kv, causal, bias, row_mask):
    call = _hf_call(heads, kv, causal, bias, row_mask)
    dout = torch.randn(call.q.shape, generator=torch.Generator().manual_seed(7)).transpose(1, 2).contiguous().transpose(1, 2)
    rows = torch.tensor([0, 3, 11, 20, 33, 47])
    expected = {**forward_stats(call, SCALES, budget_bytes=2**14), **grad_logits_stats(call, dout, SCALES, 2**14),
                **grad_logits_stats(call, dout, SCALES, 2**14, rows=rows)}
    monkeypatch.setattr(chunks, "_KV_COPY_BYTES", 0)
    assert chunks.kv_view(call.k)[1] and chunks.kv_view(call.v)[1]
    got = {**forward_stats(call, SCALES, budget_bytes=2**14), **grad_logits_stats(call, dout, SCALES, 2**14),
           **grad_logits_stats(call, dout, SCALES, 2**14, rows=rows)}
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_no_copy_of_k_or_v(monkeypatch):
    """The tensor meter over a backward on the general path: probe's own tensors stay below the
    size of one float32 copy of k (the copying route's alone is that much)."""
    monkeypatch.setattr(chunks, "_KV_COPY_BYTES", 0)
    g = torch.Generator().manual_seed(0)
    length, heads, d = 1024, 4, 64
    q = torch.randn(1, length, heads, d, generator=g).transpose(1, 2)
    kv_proj = torch.randn(1, length, 2 * heads, d, generator=g).transpose(1, 2)
    k, v = kv_proj.chunk(2, dim=1)
    bias = -0.1 * torch.arange(length, dtype=torch.float32).expand(1, heads, 1, length)
    call = AttentionCall(q=q, k=k, v=v, scale=0.125, causal=True, bias=bias)
    dout = torch.randn(q.shape, generator=g)
    copy = k.numel() * 4  # 1 MiB
    with PeakMemory(exclude=(q, kv_proj, bias, dout)) as mem:
        grad_logits_stats(call, dout, {"actual": 0.125}, 2**18)
    assert mem.peak < copy, (mem.peak, copy)
