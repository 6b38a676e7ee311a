"""A softmax over transposed scores: the keys attend over the queries.

vit-pytorch's LookViT reuses the scores of its lookup cross-attention (``q * s @ kᵀ``, queries the
low-res tokens, keys the high-res ones) in the reverse direction: ``softmax(scoresᵀ)`` lets every
high-res token attend over the low-res ones. ``(σ·q·kᵀ + b)ᵀ = σ·k·qᵀ + bᵀ``: an attention with q
and k swapped and its bias and mask transposed, at the same scale. The rule reported it from the
softmax input with q and k unswapped and the masks untransposed: with as many queries as keys
(``L == S``) a mask applied before the transpose marked the wrong keys (every row's entropy NaN
under a causal mask, no warning beyond "scale unknown"), and with ``L != S`` the statistics
failed (``NOT measured``; LookViT's ``layers.*.3``). Now measured exactly, at every scale.

Oracle: the model's own q and k in float64 (``tests.helpers.reference_metrics``), swapped, with
the transposed mask.
"""

from __future__ import annotations

import math
import warnings
from typing import List, Optional

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import probe
from tests.helpers import reference_metrics

B, H, D = 2, 2, 8


class Reverse(nn.Module):
    """Scores ``q·kᵀ·s`` (q pre-scaled, LookViT's spelling, or the scores scaled), an optional
    mask (causal fill or an additive key-padding term) applied before the transpose, then
    ``softmax(scoresᵀ) @ v`` with v from the queries' tokens; ``kv_heads``: grouped kv heads,
    repeated (``repeat_interleave``) or broadcast by the product."""

    def __init__(self, mask: Optional[str] = None, prescale: bool = True, kv_heads: int = H,
                 broadcast: bool = False) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(16, H * D), nn.Linear(16, kv_heads * D)
        self.v = nn.Linear(16, H * D)
        self.mask, self.prescale, self.kv_heads, self.broadcast = mask, prescale, kv_heads, broadcast
        self.raw: List[Tensor] = []

    def forward(self, x: Tensor, ctx: Tensor) -> Tensor:
        heads = lambda t, h: t.view(B, t.shape[1], h, D).transpose(1, 2)  # noqa: E731
        q, k, v = heads(self.q(x), H), heads(self.k(ctx), self.kv_heads), heads(self.v(x), H)
        self.raw = [q.detach().double(), k.detach().double()]
        if self.kv_heads != H and not self.broadcast:
            k = k.repeat_interleave(H // self.kv_heads, dim=1)
        s = (q * D ** -0.5) @ k.transpose(-1, -2) if self.prescale else q @ k.transpose(-1, -2) * D ** -0.5
        L, S = s.shape[-2:]
        if self.mask == "causal":
            s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
        elif self.mask == "padding":  # the last keys of the second batch row padded
            pad = torch.zeros(B, 1, 1, S)
            pad[1, ..., S - 2:] = -1e9
            s = s + pad
        attn = s.transpose(-1, -2).softmax(dim=-1)
        return (attn @ v).square().sum()


def _valid(mask: Optional[str], L: int, S: int) -> Tensor:
    """The transposed call's (B, H, S, L) valid keys."""
    valid = torch.ones(B, H, L, S, dtype=torch.bool)
    if mask == "causal":
        valid &= ~torch.ones(L, S, dtype=torch.bool).triu(1)
    elif mask == "padding":
        valid[1, ..., S - 2:] = False
    return valid.transpose(-1, -2)


def _run(model: nn.Module, L: int, S: int) -> tuple:
    torch.manual_seed(1)
    x, ctx = torch.randn(B, L, 16), torch.randn(B, S, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, every=1, rows=None) as p:
            model(x, ctx).backward()
    return p.summary(), [str(w.message) for w in caught if "probe" in str(w.message)]


@pytest.mark.parametrize("prescale", [True, False], ids=["q prescaled", "scores scaled"])
@pytest.mark.parametrize("L,S,mask", [(4, 6, None), (6, 4, None), (6, 6, "causal"), (5, 5, "padding"),
                                      (4, 6, "padding")])
def test_a_softmax_over_transposed_scores_is_attention_with_q_and_k_swapped(L: int, S: int, mask: Optional[str],
                                                                            prescale: bool) -> None:
    torch.manual_seed(0)
    model = Reverse(mask, prescale)
    s, caught = _run(model, L, S)
    assert not caught, caught
    assert s.sites == ["root"]
    info = s.info("root")
    assert info["scale"] == pytest.approx(D ** -0.5) and not info.get("scale_unknown"), info
    q, k = model.raw
    valid = _valid(mask, L, S)
    for scale, name in ((D ** -0.5, "actual"), (1.0, "unscaled"), (D ** -0.5, "standard")):
        ref = reference_metrics(k, q, scale, valid)  # the keys' rows are the queries
        for metric in ("logit_var", "logit_max", "entropy", "max_prob", "saturation"):
            np.testing.assert_allclose(s.value("root", metric, name), ref[metric], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{metric} at {name}")
    for g in ("grad_q", "grad_k", "grad_v"):
        assert g in s.metrics("root"), (g, s.metrics("root"))
    assert all(math.isfinite(float(v)) for v in s.value("root", "grad_q", "actual"))


def test_transposed_scores_with_grouped_kv_heads() -> None:
    """Repeated kv heads are the product's k: exact. Broadcast by the product (k keeps its one
    head, which cannot become the queries of two heads): not recorded, and the audit says so."""
    torch.manual_seed(0)
    model = Reverse(kv_heads=1)
    s, caught = _run(model, 4, 6)
    assert not caught and s.info("root")["scale"] == pytest.approx(D ** -0.5), caught
    q, k = model.raw
    ref = reference_metrics(k.repeat_interleave(H, dim=1), q, D ** -0.5, _valid(None, 4, 6))
    np.testing.assert_allclose(s.value("root", "entropy", "actual"), ref["entropy"],
                               rtol=1e-5, atol=1e-6)
    s, caught = _run(Reverse(kv_heads=1, broadcast=True), 4, 6)
    assert "root" not in s.sites
    assert any("'root' is NOT measured" in w for w in caught), caught
