"""Learned queries: a parameter times an activation's tokens, softmaxed over the tokens, is attention.

vit-pytorch's ``PatchMerger`` pools the tokens with ``softmax(self.queries @ xᵀ · s) @ x``: one
head, q the parameter, k = v = the normed tokens. probe read the product with a parameter as a
projection and neither measured it nor named it. It is now a site: q the parameter broadcast to
the batch, k the tokens, at the factor on the scores. grad_q is the gradient of the model's own
q only when the model expanded the parameter to the batch itself (a broadcast parameter has
only the batch sum); else it is named. A parameter on the right (a classifier, a router), a
softmax over the parameter's rows, and a channels-first projection ``W @ x`` used as keys stay
what they were.

With k = xᵀ and v = x, x's gradient holds k's (its view) and v's: grad_v is named (it was their
sum, without a word, where probe measured the attention: queries repeated per batch row).

Oracle: the module's own queries and tokens in float64 (``tests.helpers.reference_metrics``) at
the module's scale and without it; gradients from the same attention rebuilt on separate leaves.
"""

from __future__ import annotations

import warnings
from typing import List, Tuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import probe
from tests.helpers import reference_metrics

B, T, D, N, H = 2, 9, 16, 4, 2
SCALE = D ** -0.5


class Merger(nn.Module):
    """PatchMerger and its spellings. ``raw``: (q, k, v) as (B, H, n, d) leaves of the module's
    own values, for the oracle."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.norm = nn.LayerNorm(D)
        self.queries = nn.Parameter(torch.randn(N, D))
        self.to_q = nn.Linear(D, D)
        self.raw: List[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(x)
        if self.style in ("scaled", "projected", "projected 2-d"):  # queries computed from weights
            q = self.to_q(self.queries[None]) if self.style == "projected" else self.queries
            if self.style == "projected 2-d":
                q = self.to_q(self.queries)
            sim = (q * SCALE) @ x.transpose(-1, -2) if self.style != "projected" else q @ x.transpose(-1, -2) * SCALE
            self.raw = [q.reshape(1, 1, N, D).expand(B, 1, N, D), x[:, None], x[:, None]]
        elif self.style == "scaled heads":  # computed from the weight, split into heads: (H, N, d) against (B, H, T, d)
            q = (self.queries * SCALE).view(N, H, D // H).transpose(0, 1)
            x = x.view(B, T, H, D // H).transpose(1, 2)
            sim = torch.matmul(q, x.transpose(-1, -2))
            self.raw = [(q / SCALE).expand(B, H, N, D // H), x, x]
        elif self.style == "heads":  # the queries split into heads like the tokens: (H, N, d) against (B, H, T, d)
            q = self.queries.view(N, H, D // H).transpose(0, 1)
            x = x.view(B, T, H, D // H).transpose(1, 2)
            sim = torch.matmul(q, x.transpose(-1, -2)) * SCALE
            self.raw = [q.expand(B, H, N, D // H), x, x]
        elif self.style == "einsum":
            sim = torch.einsum("nd,btd->bnt", self.queries, x) * SCALE
            self.raw = [self.queries.expand(B, 1, N, D), x[:, None], x[:, None]]
        else:
            q = self.queries if self.style == "plain" else self.queries.expand(x.shape[0], -1, -1)
            sim = torch.matmul(q, x.transpose(-1, -2)) * SCALE  # vit-pytorch's PatchMerger
            self.raw = [self.queries.expand(B, 1, N, D), x[:, None], x[:, None]]
        out = torch.matmul(sim.softmax(dim=-1), x)
        self.raw = [t.detach().double().clone() for t in self.raw]
        return out.square().sum()


def _run(model: nn.Module, x: Tensor) -> Tuple[object, List[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, every=1, rows=None) as p:
            model(x).backward()
        s = p.summary()
    return s, [str(w.message) for w in caught]


def _reference_grads(q: Tensor, k: Tensor, v: Tensor) -> dict:
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    (torch.matmul((q @ k.transpose(-1, -2) * SCALE).softmax(-1), v)).square().sum().backward()
    return {f"grad_{n}": t.grad.square().sum((0, 2, 3)).sqrt().numpy() for n, t in (("q", q), ("k", k), ("v", v))}


@pytest.mark.parametrize("style", ["plain", "expand", "heads", "einsum", "scaled", "projected", "projected 2-d",
                                   "scaled heads"])
def test_learned_queries_are_measured_at_every_scale(style: str) -> None:
    torch.manual_seed(0)
    model = Merger(style)
    s, caught = _run(model, torch.randn(B, T, D))
    assert s.sites == ["root"], (s.sites, caught)
    info = s.info("root")
    heads = H if "heads" in style else 1
    assert info["heads"] == heads and info["scale"] == pytest.approx(SCALE) and not info.get("scale_unknown"), info
    q, k, _ = model.raw
    valid = torch.ones(B, heads, N, T, dtype=torch.bool)
    for scale, name in ((SCALE, "actual"), (1.0, "unscaled")):
        ref = reference_metrics(q, k, scale, valid)
        for metric in ("logit_var", "logit_max", "entropy", "max_prob", "saturation"):
            np.testing.assert_allclose(s.value("root", metric, name), ref[metric], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{metric} at {name}")


@pytest.mark.parametrize("style", ["plain", "expand", "heads"])
def test_grad_q_of_learned_queries_is_measured_or_named(style: str) -> None:
    """A parameter broadcast in the product has only its batch sum: grad_q is named. Expanded to
    the batch by the model, its own (B, N, D) tensor has each row's gradient: measured. k = xᵀ
    and v = x: x's gradient holds k's, so grad_v is named and grad_k measured."""
    torch.manual_seed(0)
    model = Merger(style)
    s, caught = _run(model, torch.randn(B, T, D))
    ref = _reference_grads(*model.raw)
    not_measured = s.info("root").get("not_measured", {})
    np.testing.assert_allclose(s.value("root", "grad_k"), ref["grad_k"], rtol=1e-4)
    assert "grad_v" in not_measured and "computed from" in not_measured["grad_v"], not_measured
    if style == "expand":
        np.testing.assert_allclose(s.value("root", "grad_q"), ref["grad_q"], rtol=1e-4)
    else:
        assert "summed over the batch" in not_measured.get("grad_q", ""), not_measured
        assert any("grad_q" in w and "NOT measured" in w for w in caught), caught


def test_k_a_view_of_v_names_grad_v() -> None:
    """``q = queries.repeat(B, 1, 1)`` was measured before learned queries (an activation), with
    grad_v the gradient of x: v's and k's (``xᵀ``) summed, 1.4x the true value here."""
    class Repeated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.queries = nn.Parameter(torch.randn(N, D))

        def forward(self, x: Tensor) -> Tensor:
            q = self.queries.repeat(x.shape[0], 1, 1)
            return torch.matmul((q @ x.transpose(-1, -2) * SCALE).softmax(-1), x).square().sum()

    torch.manual_seed(0)
    s, caught = _run(Repeated(), torch.randn(B, T, D, requires_grad=True))
    assert "grad_v" in s.info("root").get("not_measured", {}), s.info("root")
    assert any("grad_v" in w and "computed from the tensor passed as v" in w for w in caught), caught


class NotAttention(nn.Module):
    """One real attention (SDPA) and a softmax of a product with a parameter that
    is not attention (``head``), or a channels-first projection used as keys (``keys``)."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.qkv = nn.Linear(D, 3 * D)
        self.w = nn.Parameter(torch.randn(N, D))
        self.wk = nn.Parameter(torch.randn(D, D))

    def forward(self, x: Tensor) -> Tensor:
        out = F.scaled_dot_product_attention(*self.qkv(x)[:, None].chunk(3, -1)).sum()
        if self.style == "classifier":
            head = F.linear(x, self.w).softmax(-1)
        elif self.style == "router":
            head = (x @ self.w.T).softmax(-1)
        elif self.style == "over rows":
            head = (self.w @ x.transpose(-1, -2)).softmax(dim=-2)
        elif self.style == "transposed":  # softmax over the parameter's rows, spelled as scoresᵀ
            head = (self.w @ x.transpose(-1, -2)).transpose(-1, -2).softmax(-1)
        else:  # keys: k = Wk @ xᵀ (channels-first), then q @ k: a q·kᵀ at scale 1/sqrt(D)
            q, k, v = self.qkv(x).chunk(3, -1)
            head = ((q @ (self.wk @ k.transpose(-1, -2))) * SCALE).softmax(-1) @ v
        return out + head.square().sum()


@pytest.mark.parametrize("style", ["classifier", "router", "over rows", "transposed"])
def test_a_softmax_over_a_parameters_rows_is_no_site(style: str) -> None:
    torch.manual_seed(0)
    s, caught = _run(NotAttention(style), torch.randn(B, T, D))
    assert s.sites == ["root"] and caught == [], (s.sites, caught)


def test_a_channels_first_projection_used_as_keys_keeps_its_scale() -> None:
    torch.manual_seed(0)
    s, caught = _run(NotAttention("keys"), torch.randn(B, T, D))
    eager = [site for site in s.sites if s.info(site)["kind"] == "eager"]
    assert len(eager) == 1 and not any("NOT measured" in w or "scale" in w for w in caught), (s.sites, caught)
    info = s.info(eager[0])
    assert info["scale"] == pytest.approx(SCALE) and not info.get("scale_unknown"), info


@pytest.mark.parametrize("style", ["scaled", "projected", "projected 2-d"])
def test_learned_queries_capture_misses_are_named_by_the_audit(style: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Queries computed from weights (``(self.queries * s) @ xᵀ``, ``self.to_q(self.latents) @ xᵀ``)
    were neither measured nor named beside another attention: the audit followed products of two
    activations only. With the capture's rule for them switched off, the audit names the miss."""
    import probe.capture.rules_products as rules_products
    monkeypatch.setattr(rules_products, "shared_rows", lambda a, b: False)

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(D, 3 * D)
            self.pool = Merger(style)

        def forward(self, x: Tensor) -> Tensor:
            return F.scaled_dot_product_attention(*self.qkv(x)[:, None].chunk(3, -1)).sum() + self.pool(x)

    torch.manual_seed(0)
    s, caught = _run(Both(), torch.randn(B, T, D))
    assert s.sites == ["root"], s.sites
    assert any("at 'pool' is NOT measured" in w and "not taken as q·kᵀ" in w for w in caught), caught

