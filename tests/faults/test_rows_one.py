"""``rows=1``: one sampled query row gives an unbiased estimate but no estimate of its spread. The
standard errors were 0 (an exact value, to anyone judging them); they are NaN: unknown."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import probe


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.proj(x).view(2, 6, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).sum()


def test_one_sampled_row_has_an_unknown_standard_error():
    torch.manual_seed(0)
    model, x = _Attn(), torch.randn(2, 6, 8)
    with probe.watch(model, rows=1) as p:
        model(x).backward()
    s = p.summary()
    site = s.sites[0]
    for metric in ("entropy", "max_prob", "saturation", "grad_logits"):
        assert all(math.isfinite(v) for v in s.value(site, metric)), metric  # the estimate itself
        assert all(math.isnan(v) for v in s.value(site, f"{metric}_se")), metric
    with probe.watch(model, rows=2) as p:  # two rows: a finite standard error
        model(x).backward()
    assert all(math.isfinite(v) for v in p.summary().value(site, "entropy_se"))
