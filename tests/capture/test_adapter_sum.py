"""An adapter's factor is part of the projection, not a scale on ``q·kᵀ``.

peft's LoRA computes ``q = base(x) + lora_B(lora_A(x)) * s``: the factor ``s`` scales one
addend, so ``q = (W + s·BA)·x`` is a projection with another weight, and the attention scale is
still the one the call declares. The rules read any factor on q as part of the scale and made
every LoRA site "scale unknown" (reported at ``actual`` only, warned), the most common way to
fine-tune a transformer. Only that shape is new features; a factor on the whole q, or on q with
a broadcast bias or q itself added, still is (or hides) a scale.

Oracle: the model's own q and k in float64 (``tests.helpers.reference_metrics``) at the call's
scale and without it.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, List

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import probe
from tests.helpers import reference_metrics

B, H, L, D = 2, 2, 8, 16
W = H * D


class Adapted(nn.Module):
    """One attention layer whose q comes from ``combine(x, base, down, up)``; ``eager``: an
    explicit softmax (scores divided by ``sqrt(D)``), else SDPA with its default scale."""

    def __init__(self, combine: Callable[..., Tensor], eager: bool = False) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)
        self.down, self.up = nn.Linear(W, 4, bias=False), nn.Linear(4, W, bias=False)
        nn.init.normal_(self.up.weight, std=0.3)
        self.bias = nn.Parameter(torch.randn(W))
        self.combine, self.eager = combine, eager
        self.raw: List[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        heads = lambda t: t.view(B, L, H, D).transpose(1, 2)  # noqa: E731
        q = heads(self.combine(self, x))
        k, v = heads(self.k(x)), heads(self.v(x))
        self.raw = [q.detach().double(), k.detach().double()]
        if self.eager:
            out = (q @ k.transpose(-1, -2) / math.sqrt(D)).softmax(-1) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        return out.square().sum()


def lora(m: Adapted, x: Tensor) -> Tensor:
    return m.q(x) + m.up(m.down(x)) * 2.0  # peft's spelling (scaling = alpha / r)


def lora_divided(m: Adapted, x: Tensor) -> Tensor:
    return m.up(m.down(F.dropout(x, 0.0))) / 0.5 + m.q(x)


def _run(model: Adapted) -> tuple:
    torch.manual_seed(1)
    x = torch.randn(B, L, W)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, every=1, rows=None) as p:
            model(x).backward()
    return p.summary(), [str(w.message) for w in caught]


@pytest.mark.parametrize("eager", [False, True], ids=["sdpa", "eager"])
@pytest.mark.parametrize("combine", [lora, lora_divided], ids=["times", "divided"])
def test_a_lora_style_sum_keeps_the_call_scale(combine: Callable[..., Tensor], eager: bool) -> None:
    torch.manual_seed(0)
    model = Adapted(combine, eager)
    s, caught = _run(model)
    assert not any("could not be recovered" in w for w in caught), caught
    info = s.info("root")
    assert info["scale"] == pytest.approx(1 / math.sqrt(D)) and not info.get("scale_unknown"), info
    q, k = model.raw
    valid = torch.ones(B, H, L, L, dtype=torch.bool)
    for scale, name in ((1 / math.sqrt(D), "actual"), (1.0, "unscaled")):
        ref = reference_metrics(q, k, scale, valid)
        for metric in ("logit_var", "logit_max", "entropy", "max_prob"):
            np.testing.assert_allclose(s.value("root", metric, name), ref[metric], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{metric} at {name}")


@pytest.mark.parametrize("combine", [
    lambda m, x: m.q(x) * 0.5,  # a factor on the whole q: part of the scale (known, 0.5/sqrt(D))
], ids=["whole q"])
def test_a_factor_on_the_whole_q_is_still_the_scale(combine: Callable[..., Tensor]) -> None:
    torch.manual_seed(0)
    model = Adapted(combine)
    s, _ = _run(model)
    assert s.info("root")["scale"] == pytest.approx(0.5 / math.sqrt(D))


@pytest.mark.parametrize("combine", [
    lambda m, x: (lambda t: t + t * 0.5)(m.q(x)),  # q + q·s: the factor 1 + s on q
    lambda m, x: m.q(x) * 0.5 + m.bias,  # a broadcast bias after the factor
    lambda m, x: (lambda t: t * 0.5 + t.detach())(m.q(x)),  # q itself again, another tensor object
], ids=["q plus q times s", "broadcast bias", "q plus its detached self"])
def test_a_sum_that_may_hide_a_scale_stays_unknown(combine: Callable[..., Tensor]) -> None:
    """Not the adapter's shape: the factor is still read as hidden, and said."""
    torch.manual_seed(0)
    model = Adapted(combine)
    s, caught = _run(model)
    assert any("could not be recovered" in w for w in caught), caught
    assert s.info("root")["scale"] is None
