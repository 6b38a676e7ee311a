"""Attention whose weights are not a softmax probe can measure is named, never silently absent.

x-transformers' ``attn_sigmoid`` (``sigmoid(q·kᵀ·s) @ v``) and ``attn_gumbel_softmax``
(``F.gumbel_softmax(q·kᵀ·s) @ v``) ran with no row in ``probe.coverage`` and no warning: the audit
looked only for softmaxes, and ``F.gumbel_softmax`` is one call the torch-function modes cannot
look into (its noise is drawn inside). Both are now attention events the audit names ("NOT
measured", with the reason), and so is YOSO's arc-cosine kernel ``(1 - acos(q̂·k̂)/π)^τ @ v``
(0 sites and no warning before: found by ``benchmarks/hf_auto_sweep.py``); a sigmoid or a kernel
counts once its output multiplies an activation, and only over scores of one product (no norm or
second product since: hyper-connection gates over a normed residual stream are not attention). Next to them a softmax attention is still measured
exactly (oracle: the model's own q and k in float64).
"""

from __future__ import annotations

import math
import warnings
from typing import List

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import probe
from tests.helpers import reference_metrics

B, H, L, D = 2, 2, 8, 8
W = H * D


class Attn(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.qkv = nn.Linear(W, 3 * W)
        self.gate = nn.Parameter(torch.randn(L) * 0.3)  # a vector (x-transformers' hyper connections)
        self.kind = kind
        self.raw: List[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        self.raw = [q.detach().double(), k.detach().double()]
        s = torch.einsum("bhid,bhjd->bhij", q, k) * D ** -0.5
        if self.kind == "sigmoid":
            p = F.sigmoid(s)
        elif self.kind == "gumbel":
            p = F.gumbel_softmax(s, tau=0.5, hard=False, dim=-1)
        elif self.kind == "kernel":  # YOSO's expectation attention: an arc-cosine kernel of normalized q and k
            c = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
            p = (1 - torch.acos(c.clamp(-1, 1)) / math.pi) ** 8
        elif self.kind == "gated":  # a sigmoid gate over a norm of the scores: not attention weights
            p = s.softmax(-1) * (F.layer_norm(s, (L,)) @ self.gate).sigmoid()[..., None]
        else:
            p = s.softmax(-1)
        out = torch.einsum("bhij,bhjd->bhid", p, v)
        if self.kind == "summed":  # a sigmoid of the scores summed over the keys: not weights any more
            out = out + F.sigmoid(s).sum(-1, keepdim=True).transpose(-1, -2) @ v
        return out.transpose(1, 2).reshape(B, L, W)


class Net(nn.Module):
    def __init__(self, kinds: List[str]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attn(k) for k in kinds)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _run(net: Net) -> tuple:
    x = torch.randn(B, L, W, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(net, every=1, rows=None) as p:
            net(x).square().sum().backward()
    return p.summary(), [str(w.message) for w in caught]


@pytest.mark.parametrize("kind, why", [("sigmoid", "sigmoid attention"), ("gumbel", "F.gumbel_softmax"),
                                       ("kernel", "kernel attention")])
def test_an_attention_that_is_not_a_softmax_is_named(kind: str, why: str) -> None:
    torch.manual_seed(0)
    net = Net(["softmax", kind])
    report = probe.coverage(net, torch.randn(B, L, W))
    rows = {r.site: r for r in report.rows}
    assert set(rows) == {"blocks.0", "blocks.1"}, list(rows)
    assert rows["blocks.0"].captured and not rows["blocks.1"].captured
    assert why in rows["blocks.1"].why, rows["blocks.1"].why
    s, said = _run(net)
    assert any("'blocks.1' is NOT measured" in w and why in w for w in said), said
    assert not any("'blocks.0'" in w for w in said), said
    q, k = net.blocks[0].raw  # the softmax next to it: exact
    ref = reference_metrics(q, k, D ** -0.5, torch.ones(B, H, L, L, dtype=torch.bool))
    assert s.info("blocks.0")["scale"] == pytest.approx(1 / math.sqrt(D))
    for metric in ("logit_var", "logit_max", "entropy", "max_prob"):
        np.testing.assert_allclose(s.value("blocks.0", metric, "actual"), ref[metric], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["gated", "summed"])
def test_a_sigmoid_that_is_not_attention_weights_is_quiet(kind: str) -> None:
    torch.manual_seed(0)
    report = probe.coverage(Net([kind]), torch.randn(B, L, W))
    assert [(r.site, r.captured) for r in report.rows] == [("blocks.0", True)], report.rows
