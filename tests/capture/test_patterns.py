"""The shapes of attention code that real third-party models use (issue 17), one minimal module
each: probe must find the call, name it after the module that ran the softmax, report the scale
the code really uses, and have grad_q / grad_k / grad_v after a backward, or warn.

Oracle: the module's own probabilities (kept by the module itself as it runs) in float64 for
entropy / max_prob, and the raw product of the model's own q and k (float64) for the unscaled
logit variance, which checks the traced scale. ``tests/capture/test_eager.py`` covers the plain
spellings; here are the ones that were missed, misnamed or mis-scaled.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, List, Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import probe

B, H, L, D = 2, 2, 5, 4
S0 = D ** -0.5


class Attn(nn.Module):
    """q, k, v from one projection; ``core(q, k, v) -> out`` is the pattern under test. Keeps the
    probabilities it computed (``probs``, B·H·L·S) and the unscaled q, k (``raw``)."""

    def __init__(self, core: Callable[["Attn", Tensor, Tensor, Tensor], Tensor]) -> None:
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)
        self.out = nn.Linear(H * D, H * D)
        self.core = core
        self.probs: Optional[Tensor] = None
        self.raw: Optional[tuple] = None

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, D).permute(2, 0, 3, 1, 4)
        self.raw = (q.detach().double(), k.detach().double())
        o = self.core(self, q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, n, H * D))


class Net(nn.Module):
    def __init__(self, core: Callable[..., Tensor], layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attn(core) for _ in range(layers))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def run(core: Callable[..., Tensor], grads: bool = True):
    torch.manual_seed(0)
    net = Net(core)
    x = torch.randn(B, L, H * D)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(net, grads=grads) as p:
            out = net(x)
            if grads:
                out.square().sum().backward()
        s = p.summary()
    return net, s, [str(w.message) for w in caught if "probe" in str(w.message)]


def entropy_ref(probs: Tensor) -> np.ndarray:
    """Per-head mean normalised entropy of the model's own probabilities; keys whose probability
    is exactly 0 are masked keys."""
    p = probs.detach().double().reshape(B, H, L, -1)
    valid = (p > 0).sum(-1).double()
    ent = -(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(-1) / valid.clamp(min=2).log()
    return ent.mean((0, 2)).numpy()


def check(net: Net, s, scale: float, grads: bool = True, names: Optional[List[str]] = None) -> None:
    names = names or [f"blocks.{i}" for i in range(len(net.blocks))]
    assert s.sites == names
    for name, block in zip(names, net.blocks):
        info = s.info(name)
        assert info["scale"] == pytest.approx(scale, rel=1e-6), name
        np.testing.assert_allclose(s.value(name, "entropy"), entropy_ref(block.probs), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(s.value(name, "max_prob"),
                                   block.probs.detach().double().reshape(B, H, L, -1).amax(-1).mean((0, 2)).numpy(),
                                   rtol=1e-5)
        q, k = block.raw
        raw = (q @ k.transpose(-1, -2)).reshape(B, H, -1)
        np.testing.assert_allclose(s.value(name, "logit_var", "unscaled"), _pooled_var(raw), rtol=1e-4)
        if grads:
            for g in ("grad_q", "grad_k", "grad_v"):
                assert g in s.metrics(name), f"{name}: no {g}"


def _pooled_var(raw: Tensor) -> np.ndarray:
    return raw.permute(1, 0, 2).reshape(H, -1).var(-1, unbiased=False).numpy()


def keep(m: Attn, p: Tensor) -> Tensor:
    m.probs = p
    return p


# -- D: gradient metrics -------------------------------------------------------------------------------
def core_mqa(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    # multi-query attention: one k / v head broadcast over the query heads by the product itself
    k1, v1 = k[:, :1], v[:, :1]
    m.raw = (q.detach().double(), k1.expand(B, H, L, D).detach().double())
    p = keep(m, (q @ k1.transpose(-1, -2) * S0).softmax(-1))
    return p @ v1


def test_d_multi_query_broadcast() -> None:
    net, s, _ = run(core_mqa)
    check(net, s, S0)
