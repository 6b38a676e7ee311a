"""No host synchronization in the reductions: every path runs on ``meta`` tensors.

A ``meta`` tensor has a shape and a dtype but no data, so ``.item()``, ``.tolist()``,
``bool(t)``, ``nonzero`` and boolean indexing raise on it. Running the forward reductions (both
the shifted and the general path, with and without row sampling) and the backward reductions on
``meta`` inputs proves none of them reads a value back to the host.
"""

from __future__ import annotations

import pytest
import torch

from probe.call import AttentionCall
from probe.stats.forward import forward_stats
from probe.stats.backward import grad_logits_stats, head_sq

B, H, HK, L, D = 2, 8, 2, 300, 64


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _calls():
    q, k, v = _meta(B, H, L, D), _meta(B, HK, L, D), _meta(B, HK, L, 32)
    mask = _meta(B, 1, 1, L, dtype=torch.bool)
    bias = _meta(B, 1, L, L)
    return {
        "shifted, no mask": AttentionCall(q=q, k=k, v=v, scale=0.125),
        "shifted, causal + padding": AttentionCall(q=q, k=k, v=v, scale=0.125, mask=mask, causal=True),
        "general, bias + softcap": AttentionCall(q=q, k=k, v=v, scale=0.125, bias=bias, mask=mask, causal=True,
                                                 softcap=30.0),
        "general, per-head scale": AttentionCall(q=q, k=k, v=v, scale=_meta(H)),
    }


CALLS = _calls()


def _scales(call):
    scales = {"actual": call.scale, "unscaled": 1.0, "standard": 0.125}
    if not isinstance(call.scale, torch.Tensor):
        scales["negative"] = -0.5  # a negative scale takes the general path
    return scales


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("rows", [None, 17])
def test_forward_reductions_run_on_meta(name, rows):
    call = CALLS[name]
    fields = forward_stats(call, _scales(call), budget_bytes=2**22, rows=rows,
                           generator=torch.Generator().manual_seed(0))
    assert fields and all(t.device.type == "meta" for t in fields.values())
    assert fields["entropy@unscaled"].shape == (H,)
    assert fields["logit@actual"].shape == (3, H)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_backward_reductions_run_on_meta(name):
    call = CALLS[name]
    dout = _meta(B, H, L, 32)
    fields = grad_logits_stats(call, dout, _scales(call), budget_bytes=2**23)
    assert set(fields) == {f"grad_logits_sq@{s}" for s in _scales(call)}
    assert all(t.device.type == "meta" and t.shape == (H,) for t in fields.values())
    assert head_sq(call.k).device.type == "meta" and head_sq(call.k).shape == (HK,)
