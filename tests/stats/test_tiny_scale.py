"""Scales far below 1: the masked keys stay masked.

The centred paths mask with the finite ``-2¹⁰⁰`` (``probe.stats.paths.centred.NEG``), which is
below every valid logit but gives ``exp(σ·-2¹⁰⁰) = 0`` only while ``σ·2¹⁰⁰`` is large: at a scale
of ``1e-41`` (a q multiplied by a garbage DoRA magnitude of ``3e-41``: torchtune's is
``torch.empty`` until its recipe initializes it) every masked key counted, and the normalized
entropy read 1.56, an impossible value. Such scales now take the shifted path (``-inf`` masks).
Below float32's normal range (``1e-60``: a pre-scaled q's factor times the call's scale) the
shifted path's float32 factor ``σ·log₂e`` is 0 and ``0·(-inf)`` made every entropy NaN; those
take the general path, which scales the logits before it masks them.

Oracle: ``tests.helpers.reference_metrics`` (float64, by the definitions, over the valid keys).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe
from tests.helpers import reference_metrics

B, H, L, D = 2, 2, 8, 8


class Tiny(nn.Module):
    def __init__(self, scale: float, padded: bool, eager: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)
        self.scale, self.padded, self.eager = scale, padded, eager
        self.raw = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        self.raw = (q.detach(), k.detach())
        if self.eager:  # float32 scores times the scale, then masked: a scale below float32's range gives 0, not NaN
            z = (q @ k.transpose(-1, -2) * self.scale).masked_fill(~valid(self.padded), float("-inf"))
            return (z.softmax(-1) @ v).sum()
        if self.padded:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=valid(True), scale=self.scale).sum()
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale).sum()


def valid(padded: bool) -> torch.Tensor:
    if padded:
        keep = torch.ones(B, 1, 1, L, dtype=torch.bool)
        keep[1, ..., 5:] = False
        return keep.expand(B, H, L, L)
    return torch.ones(L, L, dtype=torch.bool).tril().expand(B, H, L, L)


@pytest.mark.parametrize("scale", [1e-41, 1e-30, 2.0**-79])
@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padded"])
def test_a_tiny_scale_keeps_masked_keys_out(scale: float, padded: bool) -> None:
    _check(Tiny(scale, padded), scale, padded)


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padded"])
def test_a_scale_below_float32s_range_is_measured(padded: bool) -> None:
    """``1e-60`` (a pre-scaled q's factor times the call's scale): the model's float32 scores are 0,
    every valid key equally likely. (PyTorch's CPU SDPA kernel itself returns NaN for such a
    scale under a causal mask; probe then says the site is unverified.)"""
    _check(Tiny(1e-60, padded, eager=True), 1e-60, padded)


def _check(model: Tiny, scale: float, padded: bool) -> None:
    torch.manual_seed(0)
    model.qkv.reset_parameters()
    with probe.watch(model, every=1, rows=None) as p:
        model(torch.randn(B, L, H * D)).backward()
    s = p.summary()
    q, k = model.raw
    ref = reference_metrics(q, k, scale, valid(padded))
    for metric in ("entropy", "max_prob", "saturation"):
        np.testing.assert_allclose(s.value("root", metric, "actual"), ref[metric], rtol=1e-5, atol=1e-6, err_msg=metric)
    assert (s.value("root", "entropy", "actual") <= 1.0 + 1e-6).all()
