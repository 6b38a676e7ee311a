"""A factor on k or v before Hugging Face's ``repeat_kv`` (MiMo-V2-Flash: ``v = v_proj(x) * v_scale``).

The repeat of a tensor that already carries a factor was replayed on its unscaled base and lost
the kv heads it repeats: v was recorded per query head, k per kv head (or the reverse), so
``grad_v`` (or ``grad_k``) had another number of heads than the site's and was dropped, and with
both scaled the site reported its repeated copies as kv heads. And a KV cache's first update,
``cat([tensor([]), t])``, made a scaled k or v opaque (k: scale unknown; v: the same loss of its
kv heads). Found by the sweep of Hugging Face types (``benchmarks/hf_auto_sweep.py``).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import probe

B, L, H, HK, D = 2, 6, 4, 2, 8


def repeat_kv(t: torch.Tensor, n: int) -> torch.Tensor:
    b, hk, s, d = t.shape
    return t[:, :, None, :, :].expand(b, hk, n, s, d).reshape(b, hk * n, s, d)


class Grouped(nn.Module):
    """Grouped-query attention in transformers' eager spelling, with factors on k and v before the repeat."""

    def __init__(self, k_factor: float, v_factor: float, cache: bool) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(32, H * D), nn.Linear(32, HK * D), nn.Linear(32, HK * D)
        self.k_factor, self.v_factor, self.cache = k_factor, v_factor, cache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).view(B, L, H, D).transpose(1, 2)
        k = self.k(x).view(B, L, HK, D).transpose(1, 2) * self.k_factor
        v = self.v(x).view(B, L, HK, D).transpose(1, 2) * self.v_factor
        if self.cache:  # transformers' DynamicLayer on its first update: cat([tensor([]), k], dim=-2)
            k, v = (torch.cat([torch.tensor([]), t], dim=-2) for t in (k, v))
        for t in (k, v):
            t.retain_grad()
        self.kv = (k, v)
        self.raw = (q.detach().double(), k.detach().double() / self.k_factor)
        scores = torch.matmul(q, repeat_kv(k, H // HK).transpose(2, 3)) * D ** -0.5
        p = torch.softmax(scores, dim=-1, dtype=torch.float32)
        return torch.matmul(p, repeat_kv(v, H // HK)).transpose(1, 2).reshape(B, L, H * D)


@pytest.mark.parametrize("cache", [False, True], ids=["no cache", "empty cache"])
@pytest.mark.parametrize("k_factor,v_factor", [(1.0, 0.3), (0.3, 1.0), (0.3, 0.7)])
def test_a_factor_before_repeat_kv_keeps_the_kv_heads(k_factor: float, v_factor: float, cache: bool) -> None:
    torch.manual_seed(0)
    model = Grouped(k_factor, v_factor, cache)
    x = torch.randn(B, L, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, rows=None) as p:
            model(x).square().sum().backward()
    said = [str(w.message) for w in caught if "probe" in str(w.message)]
    assert not said, said
    s = p.summary()
    info = s.info("root")
    assert info["kv_heads"] == HK and info["scale"] == pytest.approx(k_factor * D ** -0.5)
    k, v = model.kv
    for metric, t in (("grad_k", k), ("grad_v", v)):
        ref = t.grad.double().square().sum((0, 2, 3)).sqrt().numpy()
        if metric == "grad_k":
            ref = ref * k_factor  # the gradient of the unscaled k, as for any factor taken out of k
        np.testing.assert_allclose(s.value("root", metric), ref, rtol=1e-5, err_msg=metric)
    q, k_raw = model.raw
    raw = q @ repeat_kv(k_raw, H // HK).transpose(-1, -2)  # q·kᵀ without any factor, float64
    for scale, sigma in (("actual", k_factor * D ** -0.5), ("unscaled", 1.0), ("standard", D ** -0.5)):
        z = sigma * raw
        np.testing.assert_allclose(s.value("root", "logit_max", scale), z.amax((0, 2, 3)).numpy(), rtol=1e-5)
        per_head = z.transpose(0, 1).reshape(H, -1)
        np.testing.assert_allclose(s.value("root", "logit_var", scale), per_head.var(-1, unbiased=False).numpy(),
                                   rtol=1e-4)
