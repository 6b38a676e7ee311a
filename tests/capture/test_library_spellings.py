"""Attention spellings of libraries the December library survey added (``benchmarks/survey_libs.py``),
each written out by hand here so that the tests need none of those libraries.

* torchscale's ``MultiheadAttention``: ``q *= scaling`` in place, heads folded into the batch for
  ``bmm``, then ``torch.nan_to_num(scores)`` before ``scores += causal_mask`` whenever a mask is
  given (its decoder). ``nan_to_num`` made the scores opaque: scale unknown, ``grad_v`` and
  ``grad_logits`` dropped (loudly). With its default fills it changes no finite score and keeps a
  ``-inf`` fill a mask: the record holds, and the attention is measured exactly.

Oracle: the model's own q and k in float64 (``tests.helpers.reference_metrics``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import probe
from tests.helpers import reference_metrics

B, H, L, D = 2, 2, 6, 8
W = H * D


def _watch(net: nn.Module, *args: Any) -> tuple:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(net, every=1, rows=None) as p:
            net(*args).square().sum().backward()
    return p.summary(), [str(w.message) for w in caught if "probe" in str(w.message)]


def _exact(s: Any, site: str, q: Tensor, k: Tensor, scale: float, valid: Tensor) -> None:
    for name, sigma in (("actual", scale), ("unscaled", 1.0), ("standard", 1 / math.sqrt(q.shape[-1]))):
        ref = reference_metrics(q, k, sigma, valid)
        for metric in ("logit_var", "logit_max", "entropy", "max_prob"):
            np.testing.assert_allclose(s.value(site, metric, name), ref[metric], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{site} {metric}@{name}")


# -- torchscale --------------------------------------------------------------------------------------
class TorchscaleAttn(nn.Module):
    """torchscale.component.multihead_attention.MultiheadAttention's forward, as written there."""

    def __init__(self, neginf: Any = None) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)
        self.scaling = D ** -0.5
        self.neginf = neginf
        self.raw: List[Tensor] = []

    def forward(self, x: Tensor, attn_mask: Tensor) -> Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        self.raw = [q.detach().double().view(B, L, H, D).transpose(1, 2) * self.scaling,
                    k.detach().double().view(B, L, H, D).transpose(1, 2)]
        q *= self.scaling
        q = q.view(B, L, H, D).transpose(1, 2).reshape(B * H, L, D)
        k = k.view(B, L, H, D).transpose(1, 2).reshape(B * H, L, D)
        v = v.view(B, L, H, D).transpose(1, 2).reshape(B * H, L, D)
        w = torch.bmm(q, k.transpose(1, 2))
        w = torch.nan_to_num(w) if self.neginf is None else torch.nan_to_num(w, neginf=self.neginf)
        w += attn_mask.unsqueeze(0)
        w = F.softmax(w, dim=-1, dtype=torch.float32).type_as(w)
        out = torch.bmm(w, v)
        return out.view(B, H, L, D).transpose(1, 2).reshape(B, L, W)


class Decoder(nn.Module):
    def __init__(self, **kw: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList([TorchscaleAttn(**kw), TorchscaleAttn(**kw)])

    def forward(self, x: Tensor) -> Tensor:
        # torchscale's Decoder: triu(-inf) float mask, passed as attn_mask to every self-attention
        mask = torch.triu(torch.zeros(L, L).float().fill_(float("-inf")), 1)
        for layer in self.layers:
            x = x + layer(x, mask)
        return x


def test_nan_to_num_on_the_scores_keeps_them_measured() -> None:
    torch.manual_seed(0)
    net = Decoder()
    x = torch.randn(B, L, W)
    rows = {r.site: r for r in probe.coverage(net, x).rows}
    assert set(rows) == {"layers.0", "layers.1"}, list(rows)
    for row in rows.values():
        assert row.captured and row.scale == pytest.approx(D ** -0.5), row
        assert {"grad_q", "grad_k", "grad_v", "grad_logits"} <= set(row.grads), row.grads
    s, said = _watch(net, x)
    assert not said, said
    causal = torch.ones(L, L, dtype=torch.bool).tril().expand(B, H, L, L)
    for i, layer in enumerate(net.layers):
        q, k = layer.raw
        _exact(s, f"layers.{i}", q / D ** -0.5, k, D ** -0.5, causal)


def test_nan_to_num_with_a_fill_of_its_own_is_named() -> None:
    """``neginf=0.0`` turns the causal mask's -inf into 0: keys the mask removed count again, so the
    mask probe read is not what the softmax sees: the scale is unknown, and said so."""
    torch.manual_seed(0)
    net = Decoder(neginf=0.0)
    x = torch.randn(B, L, W)
    rows = {r.site: r for r in probe.coverage(net, x).rows}
    assert all(r.captured and r.scale is None for r in rows.values()), rows
    _, said = _watch(net, x)
    assert any("'layers.0'" in w and "nan_to_num" in w for w in said), said
