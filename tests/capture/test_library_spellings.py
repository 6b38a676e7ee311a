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
from typing import Any, List

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


# -- native-sparse-attention's attend ------------------------------------------------------------------
class GroupedAttend(nn.Module):
    """native_sparse_attention_pytorch's ``attend``: q viewed as ``(B, H_kv, G, L, d)`` (query heads
    grouped per kv head), ``einsum('b h g i d, b h j d -> b h g i j')``. probe reads dim -3 (G) as the
    heads and flattens the kv heads into the batch: per-head values pool ``H_kv`` heads. With
    ``G = 1`` (as many kv heads as query heads, NSA's default) it reported 1 head for 4, silently;
    the module declares ``heads`` = 4, and probe now says so."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.heads, self.groups = H * 2, groups
        self.qkv = nn.Linear(W, 3 * 2 * W)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D).permute(2, 0, 3, 1, 4)
        kv = self.heads // self.groups
        k, v = k[:, :kv], v[:, :kv]
        q = q.reshape(B, kv, self.groups, L, D)
        sim = torch.einsum("bhgid,bhjd->bhgij", q, k) * D ** -0.5
        out = torch.einsum("bhgij,bhjd->bhgid", sim.softmax(-1), v)
        return out.reshape(B, self.heads, L, D).transpose(1, 2).reshape(B, L, 2 * W)


@pytest.mark.parametrize("groups", [1, 2])
def test_query_heads_grouped_per_kv_head_are_named(groups: int) -> None:
    torch.manual_seed(0)
    net = GroupedAttend(groups)
    s, said = _watch(net, torch.randn(B, L, W))
    assert s.info("root")["heads"] == groups  # dim -3, as read before: the pooling is what is named
    assert any("'root'" in w and "`heads` = 4" in w and "per-head" in w for w in said), said


class WindowBlocks(nn.Module):
    """(B, windows, H, N, d) with ``heads`` declared = H: dim -3 holds the heads; nothing to say."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = H
        self.qkv = nn.Linear(W, 3 * W)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).view(B, 2, L // 2, 3, H, D).permute(3, 0, 1, 4, 2, 5)
        p = (q @ k.transpose(-1, -2) * D ** -0.5).softmax(-1)
        return (p @ v).permute(0, 1, 3, 2, 4).reshape(B, L, W)


def test_windows_before_the_heads_stay_quiet() -> None:
    torch.manual_seed(0)
    s, said = _watch(WindowBlocks(), torch.randn(B, L, W))
    assert s.info("root")["heads"] == H and not said, said


# -- torchscale's RetNet -------------------------------------------------------------------------------
class Retention(nn.Module):
    """torchscale's ``MultiScaleRetention.parallel_forward``: ``k *= scaling``, ``qk = q @ kᵀ``, times
    the causal decay mask, divided by its row's absolute sum, then ``qk @ v``: linear attention, no
    softmax. It had no row in ``probe.coverage`` and no warning (0 sites); the audit now names it."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.qkv = nn.Linear(W, 3 * W)
        self.kind = kind
        decay = torch.log(1 - 2.0 ** (-5 - torch.arange(H, dtype=torch.float)))
        idx = torch.arange(L)
        mask = torch.tril(torch.ones(L, L)).bool()
        self.register_buffer("decay", torch.exp((idx[:, None] - idx[None, :]) * decay[:, None, None])
                             .masked_fill(~mask, 0))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        k = k * D ** -0.5
        qk = q @ k.transpose(-1, -2)
        if self.kind == "softmax":
            p = (qk + torch.zeros(L, L).masked_fill(self.decay[0] == 0, -math.inf)).softmax(-1)
        else:
            p = qk * self.decay
            p = p / p.detach().abs().sum(dim=-1, keepdim=True).clamp(min=1)
        return (p @ v).transpose(1, 2).reshape(B, L, W)


class Stack(nn.Module):
    def __init__(self, kinds: List[str]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Retention(k) for k in kinds)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_retention_is_named_as_linear_attention() -> None:
    torch.manual_seed(0)
    net = Stack(["softmax", "retention"])
    x = torch.randn(B, L, W)
    rows = {r.site: r for r in probe.coverage(net, x).rows}
    assert set(rows) == {"layers.0", "layers.1"}, list(rows)
    assert rows["layers.0"].captured and rows["layers.0"].scale == pytest.approx(D ** -0.5)
    assert not rows["layers.1"].captured and "linear attention" in rows["layers.1"].why, rows["layers.1"]
    _, said = _watch(net, x)
    assert any("'layers.1' is NOT measured" in w and "linear attention" in w for w in said), said
    assert not any("'layers.0'" in w for w in said), said


def test_linear_attention_kernels_that_are_not_retention_stay_quiet() -> None:
    """A Gram product used as features (``(x·xᵀ).sum(-1)``, a norm of the scores before ``@ v``) is
    not retention: no event (the softmax beside it is measured as before)."""

    class Gram(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(W, W)

        def forward(self, x: Tensor) -> Tensor:
            h = self.proj(x)
            g = h @ h.transpose(-1, -2)
            normed = F.layer_norm(g, (L,))  # a norm of the scores: not scores of one product any more
            return x + normed @ x + g.sum(-1, keepdim=True)

    torch.manual_seed(0)
    assert probe.coverage(Gram(), torch.randn(B, L, W)).rows == []


class FoldedSoftmax(nn.Module):
    """ESM-2's and torchscale's encoder: heads folded into the batch, ``softmax(scores, dtype=float32)
    .type_as(scores)``, then ``bmm(P, v)``. ``type_as`` took the scores' taint in the audit (its second
    argument), so ``P @ v`` read as scores times v: linear attention named where probe measures it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(W, 3 * W)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (t.reshape(B, L, H, D).transpose(1, 2).reshape(B * H, L, D) for t in self.qkv(x).chunk(3, -1))
        w = torch.bmm(q * D ** -0.5, k.transpose(1, 2))
        p = F.softmax(w, dim=-1, dtype=torch.float32).type_as(w)
        return torch.bmm(F.dropout(p, 0.0), v).view(B, H, L, D).transpose(1, 2).reshape(B, L, W)


def test_probabilities_cast_like_the_scores_are_not_linear_attention() -> None:
    torch.manual_seed(0)
    net = FoldedSoftmax()
    rows = probe.coverage(net, torch.randn(B, L, W)).rows
    assert [(r.site, r.captured) for r in rows] == [("root", True)], rows
    _, said = _watch(net, torch.randn(B, L, W))
    assert not said, said


# -- memory-efficient-attention-pytorch's chunks; Nyström's pseudo-inverse -------------------------------
class Chunked(nn.Module):
    """memory_efficient_attention_pytorch's ``memory_efficient_attention``: per chunk of keys
    ``e = dropout(exp(s - max(s)))``, ``e @ v`` and ``e.sum(-1)``; the chunks renormalised and the
    summed products divided by the summed weights after the product. No softmax op and no
    ``e / e.sum(-1)`` before ``@ v``: 0 sites and no warning before; now named NOT measured."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(W, 3 * W)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        q = q * D ** -0.5
        values, weights, maxes = [], [], []
        for kc, vc in zip(k.split(L // 2, dim=-2), v.split(L // 2, dim=-2)):
            s = torch.einsum("bhid,bhjd->bhij", q, kc)
            m = s.amax(dim=-1, keepdim=True).detach()
            e = F.dropout(torch.exp(s - m), p=0.0)
            values.append(torch.einsum("bhij,bhjd->bhid", e, vc))
            weights.append(e.sum(dim=-1))
            maxes.append(m.squeeze(-1))
        mx = torch.stack(maxes, -1)
        renorm = (mx - mx.amax(-1, keepdim=True)).exp()
        out = (torch.stack(values, -1) * renorm[..., None, :]).sum(-1) / (torch.stack(weights, -1) * renorm).sum(-1)[
            ..., None]
        return out.transpose(1, 2).reshape(B, L, W)


def test_a_softmax_spelled_around_its_product_with_v_is_named() -> None:
    torch.manual_seed(0)
    net = Chunked()
    x = torch.randn(B, L, W)
    ref = torch.softmax(torch.einsum("bhid,bhjd->bhij", *net.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)[:2])
                        * D ** -0.5, -1)  # the model computes this attention, chunked
    assert ref.shape == (B, H, L, L)
    rows = probe.coverage(net, x).rows
    assert [(r.site, r.captured) for r in rows] == [("root", False)], rows
    assert "spelled around its product with v" in rows[0].why, rows[0].why
    _, said = _watch(net, x)
    assert any("'root' is NOT measured" in w and "exp(scores - max) @ v" in w for w in said), said


def _pinv(x: Tensor, iters: int = 3) -> Tensor:
    """nystrom_attention's ``moore_penrose_iter_pinv``: products of products of the probabilities."""
    z = x.transpose(-1, -2) / (x.abs().sum(-1).max() * x.abs().sum(-2).max())
    eye = torch.eye(x.shape[-1])[None]
    for _ in range(iters):
        xz = x @ z
        z = 0.25 * z @ (13 * eye - (xz @ (15 * eye - (xz @ (7 * eye - xz)))))
    return z


class NystromPinv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(W, 3 * W)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        p = (q @ k.transpose(-1, -2) * D ** -0.5).softmax(-1)
        return (_pinv(p) @ (p @ v)).transpose(1, 2).reshape(B, L, W)


def test_a_power_series_of_products_is_not_linear_attention() -> None:
    """``xz @ (15·I - xz @ (7·I - xz))``: scores of a product times a tensor that carries scores too
    (not a v): no linear-attention event (it named Nyström's captured softmax NOT measured)."""
    torch.manual_seed(0)
    rows = probe.coverage(NystromPinv(), torch.randn(B, L, W)).rows
    assert [(r.site, r.captured) for r in rows] == [("root", True)], rows


# -- Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo hybrid: transformers' torch_chunk_gated_delta_rule) ----------
class GatedDeltaChunks(nn.Module):
    """transformers' ``torch_chunk_gated_delta_rule``, written out: per chunk, ``(q·kᵀ ⊙ decay) @ v_new``
    where ``v_new`` is solved from another product (``k_β·kᵀ``, a triangular solve) and the recurrent
    state (``kᵀ @ v_new``, so from the second chunk on it carries scores of scores). Linear attention
    with no softmax: 0 sites and no warning before (its v carries scores, the guard against Nyström's
    power series); now named NOT measured."""

    def __init__(self, chunk: int = 3) -> None:
        super().__init__()
        self.qkv = nn.Linear(W, 3 * W)
        self.gates = nn.Linear(W, 2 * H)
        self.chunk = chunk

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        q, k = F.normalize(q, dim=-1) * D ** -0.5, F.normalize(k, dim=-1)
        g, beta = self.gates(x).view(B, L, 2, H).permute(2, 0, 3, 1)
        g, beta = -F.softplus(g), beta.sigmoid()
        c, n = self.chunk, L // self.chunk
        q, k, v = (t.reshape(B, H, n, c, D) for t in (q, k, v))
        k_beta, v_beta = k * beta.reshape(B, H, n, c, 1), v * beta.reshape(B, H, n, c, 1)
        cum = g.reshape(B, H, n, c).cumsum(-1)
        decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(torch.ones(c, c, dtype=torch.bool).triu(1),
                                                                    -math.inf).exp()
        ut = (k_beta @ k.transpose(-1, -2)) * decay
        intra = (q @ k.transpose(-1, -2)) * decay
        new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
        k_cum = torch.linalg.solve_triangular(ut, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
        state, out = torch.zeros(B, H, D, D), torch.zeros_like(new_v)
        q, k = q * cum.exp().unsqueeze(-1), k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
        for i in range(n):
            v_new = new_v[:, :, i] - k_cum[:, :, i] @ state
            out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
            state = state * cum[:, :, i, -1].exp()[..., None, None] + k[:, :, i].transpose(-1, -2) @ v_new
        return out.reshape(B, H, L, D).transpose(1, 2).reshape(B, L, W)


class Hybrid(nn.Module):
    """Qwen3-Next's layout: a Gated DeltaNet layer, then a softmax one."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([GatedDeltaChunks(), Retention("softmax")])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_gated_delta_rule_chunks_are_named_as_linear_attention() -> None:
    torch.manual_seed(0)
    x = torch.randn(B, L, W)
    rows = {r.site: r for r in probe.coverage(Hybrid(), x).rows}
    assert set(rows) == {"layers.0", "layers.1"}, list(rows)
    assert not rows["layers.0"].captured and "linear attention" in rows["layers.0"].why, rows["layers.0"]
    assert rows["layers.1"].captured and rows["layers.1"].scale == pytest.approx(D ** -0.5)
    _, said = _watch(Hybrid(), x)
    assert any("'layers.0' is NOT measured" in w and "gated delta rule" in w for w in said), said
    assert not any("'layers.1'" in w for w in said), said


def test_qwen3_next_gated_deltanet_layers_are_named() -> None:
    """The real thing: transformers' Qwen3-Next with a linear-attention layer before a full one."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3NextConfig"):
        pytest.skip("this transformers has no Qwen3-Next")
    torch.manual_seed(0)
    cfg = transformers.Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"], attn_implementation="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its fallbacks to the reference kernels (no flash-linear-attention here)
        model = transformers.Qwen3NextForCausalLM(cfg).eval()
        rows = {r.site: r for r in probe.coverage(model, torch.randint(0, 64, (2, 10))).rows}
    assert set(rows) == {"model.layers.0.linear_attn", "model.layers.1.self_attn"}, list(rows)
    assert not rows["model.layers.0.linear_attn"].captured
    assert "linear attention" in rows["model.layers.0.linear_attn"].why
    assert rows["model.layers.1.self_attn"].captured and rows["model.layers.1.self_attn"].verified
