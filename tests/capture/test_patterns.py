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
        self.valid: Optional[Tensor] = None  # the keys the model masks, when not those of probability 0

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


def entropy_ref(probs: Tensor, valid: Optional[Tensor] = None) -> np.ndarray:
    """Per-head mean normalised entropy of the model's own probabilities; masked keys are those
    of ``valid`` False, else those whose probability is exactly 0."""
    p = probs.detach().double().reshape(B, H, L, -1)
    valid = ((p > 0) if valid is None else valid.expand_as(p)).sum(-1).double()
    ent = -(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(-1) / valid.clamp(min=2).log()
    return ent.mean((0, 2)).numpy()


def check(net: Net, s, scale: float, grads: bool = True, names: Optional[List[str]] = None) -> None:
    names = names or [f"blocks.{i}" for i in range(len(net.blocks))]
    assert s.sites == names
    for name, block in zip(names, net.blocks):
        info = s.info(name)
        q, k = block.raw
        raw = q @ k.transpose(-1, -2)
        if block.probs is None:  # a fused kernel: the model's probabilities, recomputed in float64
            block.probs = (raw * scale).softmax(-1)
        assert info["scale"] == pytest.approx(scale, rel=1e-6), name
        np.testing.assert_allclose(s.value(name, "entropy"), entropy_ref(block.probs, block.valid), rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(s.value(name, "max_prob"),
                                   block.probs.detach().double().reshape(B, H, L, -1).amax(-1).mean((0, 2)).numpy(),
                                   rtol=1e-5)
        valid = block.probs.detach().reshape(raw.shape) > 0 if block.valid is None else block.valid.expand_as(raw)
        np.testing.assert_allclose(s.value(name, "logit_var", "unscaled"), _pooled_var(raw, valid), rtol=1e-4)
        if grads:
            for g in ("grad_q", "grad_k", "grad_v"):
                assert g in s.metrics(name), f"{name}: no {g}"


def _pooled_var(raw: Tensor, valid: Tensor) -> np.ndarray:
    """Per-head variance of the unscaled logits over the valid entries, pooled over the batch."""
    out = []
    for h in range(H):
        x = raw[:, h][valid[:, h]]
        out.append(float(((x - x.mean()) ** 2).mean()))
    return np.array(out)


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


def core_keyword_baddbmm(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    # Bloom: baddbmm with its batches passed by keyword
    q3, k3, v3 = (t.reshape(B * H, L, D) for t in (q, k, v))
    bias = torch.zeros(B * H, 1, L)
    scores = torch.baddbmm(bias, batch1=q3, batch2=k3.transpose(1, 2), beta=1.0, alpha=S0)
    p = keep(m, scores.softmax(-1))
    return torch.bmm(p, v3).view(B, H, L, D)


def test_a3_baddbmm_by_keyword() -> None:
    net, s, _ = run(core_keyword_baddbmm)
    check(net, s, S0)


def core_repeat_kv(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    # Hugging Face repeat_kv on a grouped-query layout (one kv head repeated over the H heads)
    k1, v1 = k[:, :1], v[:, :1]
    kr = k1[:, :, None].expand(B, 1, H, L, D).reshape(B, H, L, D)
    vr = v1[:, :, None].expand(B, 1, H, L, D).reshape(B, H, L, D)
    m.raw = (q.detach().double(), kr.detach().double())
    p = keep(m, (q @ kr.transpose(2, 3) * S0).softmax(-1))
    return p @ vr


def test_d_repeat_kv_has_grad_v() -> None:
    net, s, _ = run(core_repeat_kv)
    check(net, s, S0)


def core_swin_view(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    attn = q * S0 @ k.transpose(-2, -1)
    mask = torch.zeros(B, L, L)
    mask[:, :, -1] = float("-inf")
    attn = attn.view(-1, B, H, L, L) + mask.unsqueeze(1).unsqueeze(0)
    attn = attn.view(-1, H, L, L)
    return keep(m, attn.softmax(-1)) @ v


def test_a1_scores_viewed_to_5d_and_back() -> None:
    net, s, _ = run(core_swin_view)
    check(net, s, S0)


def core_5d(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    q5, k5, v5 = (t.unsqueeze(1) for t in (q, k, v))  # (B, T=1, H, N, d)
    p = keep(m, (q5 @ k5.transpose(-2, -1) * S0).softmax(-1))
    return (p @ v5).squeeze(1)


def test_a2_five_dims_eager() -> None:
    net, s, _ = run(core_5d)
    check(net, s, S0)


def core_5d_sdpa(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    q5, k5, v5 = (t.unsqueeze(1) for t in (q, k, v))
    return F.scaled_dot_product_attention(q5, k5, v5).squeeze(1)


def test_a2_five_dims_sdpa() -> None:
    net, s, _ = run(core_5d_sdpa)
    check(net, s, S0)


def core_floor(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    scores = q @ k.transpose(-1, -2) * S0
    scores = torch.max(scores, torch.tensor(torch.finfo(scores.dtype).min))
    return keep(m, scores.softmax(-1)) @ v


def test_a4_floor() -> None:
    net, s, _ = run(core_floor)
    check(net, s, S0)


@torch.jit.script
def softclamp(t: Tensor, value: float) -> Tensor:
    return (t / value).tanh() * value


def core_script(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    scores = softclamp(q @ k.transpose(-1, -2) * S0, 50.0)
    return keep(m, scores.softmax(-1)) @ v


def test_a6_torchscript_is_warned() -> None:
    net, s, warned = run(core_script)
    assert any("blocks.0" in w for w in warned), warned


def core_einsum_pv(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    p = keep(m, (q @ k.transpose(-1, -2) * S0).softmax(-1))
    return torch.einsum("bnij,bjnd->bind", p, v.transpose(1, 2)).transpose(1, 2)


def test_b_einsum_pv_named_by_softmax_module() -> None:
    net, s, _ = run(core_einsum_pv)
    check(net, s, S0)


def core_gated(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    patch = (q @ k.transpose(-1, -2) * S0).softmax(-1)
    pos = torch.linspace(0, 1, L * L).view(1, 1, L, L).expand(B, H, L, L).softmax(-1)
    g = 0.3
    p = keep(m, (1 - g) * patch + g * pos)
    m.probs = patch
    return p @ v


def test_b_gated_probabilities_named_by_softmax_module() -> None:
    net, s, _ = run(core_gated)
    check(net, s, S0, grads=False)


def core_prescaled_sdpa(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q * S0, k, v, scale=1.0)


def test_c_sdpa_prescaled_q() -> None:
    net, s, _ = run(core_prescaled_sdpa)
    check(net, s, S0)


def core_deberta(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    c = math.sqrt(D * 3)
    q3, k3, v3 = (t.reshape(B * H, L, D) for t in (q, k, v))
    scores = torch.bmm(q3, k3.transpose(-1, -2) / torch.tensor(c, dtype=q.dtype))
    p = keep(m, scores.view(B, H, L, L).softmax(-1))
    return (p @ v)


def test_c_k_divided() -> None:
    net, s, _ = run(core_deberta)
    check(net, s, 1 / math.sqrt(3 * D))


def core_opt_eager(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    qs = (q.transpose(1, 2).reshape(B, L, H * D) * S0).view(B, L, H, D).transpose(1, 2)
    p = keep(m, (qs @ k.transpose(-1, -2)).softmax(-1))
    return p @ v


def test_d_prescaled_then_viewed_has_grad_q() -> None:
    net, s, _ = run(core_opt_eager)
    check(net, s, S0)


def core_bias_mask(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    mask = torch.zeros(L, L)
    mask[:, -2:] = -100.0
    scores = q @ k.transpose(-1, -2) * S0 + mask
    m.valid = mask > -100  # Swin's -100 masks its keys: their probability e^-100 vanishes
    p = keep(m, scores.softmax(-1))
    return p @ v


def test_f_large_negative_bias_is_masked() -> None:
    net, s, _ = run(core_bias_mask)
    check(net, s, S0)


# -- C: a factor applied before a rotary embedding (ESM, rotary-embedding-torch) ----------------------
def rope(t: Tensor) -> Tensor:
    """Hugging Face's rotary embedding (``rotate_half`` form): linear in ``t``."""
    pos = torch.arange(t.shape[-2], dtype=t.dtype)[:, None]
    freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=t.dtype) / D))
    emb = torch.cat((pos * freq, pos * freq), -1)
    x1, x2 = t[..., : D // 2], t[..., D // 2:]
    return t * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()


def core_esm(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    m.raw = (rope(q).detach().double(), rope(k).detach().double())
    scores = rope(q * S0) @ rope(k).transpose(-1, -2)
    return keep(m, scores.softmax(-1)) @ v


def core_esm_sdpa(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    m.raw = (rope(q).detach().double(), rope(k).detach().double())
    return F.scaled_dot_product_attention(rope(q * S0), rope(k), v, scale=1.0)


def rope_complex(t: Tensor) -> Tensor:
    """Meta's reference Llama rotary embedding: pairs as complex numbers times ``exp(i·θ)``."""
    pos = torch.arange(t.shape[-2], dtype=torch.float32)[:, None]
    theta = pos / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    z = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
    return torch.view_as_real(z * torch.polar(torch.ones_like(theta), theta)).flatten(-2).type_as(t)


def core_complex_rotary(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    m.raw = (rope_complex(q).detach().double(), rope_complex(k).detach().double())
    scores = rope_complex(q * S0) @ rope_complex(k).transpose(-1, -2)
    return keep(m, scores.softmax(-1)) @ v


def core_complex_rotary_sdpa(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    m.raw = (rope_complex(q).detach().double(), rope_complex(k).detach().double())
    return F.scaled_dot_product_attention(rope_complex(q * S0), rope_complex(k), v, scale=1.0)


@pytest.mark.parametrize("core", [core_esm, core_esm_sdpa, core_complex_rotary, core_complex_rotary_sdpa],
                         ids=["eager", "sdpa", "complex-eager", "complex-sdpa"])
def test_c_factor_before_rotary(core) -> None:
    net, s, _ = run(core)
    check(net, s, S0)
    assert "q multiplied by" in s.info("blocks.0")["scale_from"]


def core_factor_then_norm(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    qs = q * 3.0
    qn = qs * torch.rsqrt(qs.pow(2).mean(-1, keepdim=True) + 1e-6)  # an RMS norm cancels the factor
    m.raw = (qn.detach().double(), k.detach().double())
    return keep(m, (qn @ k.transpose(-1, -2)).softmax(-1)) @ v


def test_c_a_norm_after_the_factor_makes_the_scale_unknown() -> None:
    # a multiplier constant along the features may be a norm of q that cancels the factor (here
    # it does), or not: the scale is not attributed (`actual` only, exact, one warning per site)
    net, s, warned = run(core_factor_then_norm, grads=False)
    for name, block in zip(s.sites, net.blocks):
        assert s.info(name)["scale"] is None and "after its factor" in s.info(name)["scale_unknown"]
        np.testing.assert_allclose(s.value(name, "entropy"), entropy_ref(block.probs), rtol=1e-5, atol=1e-6)
        q, k = block.raw
        np.testing.assert_allclose(s.value(name, "logit_var"),
                                   _pooled_var(q @ k.transpose(-1, -2), torch.ones(B, H, L, L, dtype=torch.bool)),
                                   rtol=1e-4)
        assert "unscaled" not in s.to_dict()["sites"][name]["metrics"]["entropy"]
        assert any(name in w and "`actual` only" in w for w in warned), warned


# -- A5: heads mixed before the softmax (talking heads) ------------------------------------------------
MIX = torch.eye(H) * 0.5 + 0.25  # (H, G): head h's weight in mixed head g


def core_talking_heads_conv(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    sim = q @ k.transpose(-1, -2) * S0
    sim = sim + F.conv2d(sim, MIX.t().reshape(H, H, 1, 1))  # x-transformers' pre-softmax talking heads
    return keep(m, sim.softmax(-1)) @ v


def core_talking_heads_einsum(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    mask = torch.zeros(L, L)
    mask[:, -1] = 0.7  # a bias before the mix is mixed too
    sim = torch.einsum("bhij,hg->bgij", q @ k.transpose(-1, -2) * S0 + mask, torch.eye(H) + MIX)
    return keep(m, sim.softmax(-1)) @ v


@pytest.mark.parametrize("core", [core_talking_heads_conv, core_talking_heads_einsum], ids=["conv", "einsum"])
def test_a5_talking_heads_are_measured_at_every_scale(core) -> None:
    # The mixed logits Σ_h M_hg (σ·R_h + b_h) scale with σ: unscaled = the mixed raw products.
    net, s, warned = run(core)
    assert s.sites == ["blocks.0", "blocks.1"]
    for name, block in zip(s.sites, net.blocks):
        q, k = block.raw
        mixed = torch.einsum("bhij,hg->bgij", q @ k.transpose(-1, -2), (torch.eye(H) + MIX).double())
        info = s.info(name)
        assert info["scale"] == pytest.approx(S0) and info["d_k"] == D
        valid = torch.ones_like(mixed, dtype=torch.bool)
        np.testing.assert_allclose(s.value(name, "logit_var", "unscaled"), _pooled_var(mixed, valid), rtol=1e-4)
        np.testing.assert_allclose(s.value(name, "logit_var", "standard"), _pooled_var(mixed, valid) / D, rtol=1e-4)
        np.testing.assert_allclose(s.value(name, "entropy"), entropy_ref(block.probs), rtol=1e-5, atol=1e-6)
        for g in ("grad_logits", "grad_q", "grad_k", "grad_v"):  # grad_q / grad_k: the model's q, k before the mix
            assert g in s.metrics(name), f"{name}: no {g}"
    assert not warned, warned


def core_talking_heads_masked(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    mask = torch.zeros(H, L, L, dtype=torch.bool)
    mask[0] = torch.ones(L, L).triu(1).bool()  # head 0 causal, head 1 not: the heads disagree
    sim = (q @ k.transpose(-1, -2) * S0).masked_fill(mask, -1e9)
    sim = torch.einsum("bhij,hg->bgij", sim, MIX)  # entries masked in one head mixed into others: not describable
    return keep(m, sim.softmax(-1)) @ v


def core_talking_heads_after_a_shared_mask(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    pad = torch.zeros(B, 1, 1, L, dtype=torch.bool)
    pad[1, ..., -1] = True  # the same keys for every head
    sim = (q @ k.transpose(-1, -2) * S0).masked_fill(pad, -1e9)
    m.valid = ~pad
    return keep(m, torch.einsum("bhij,hg->bgij", sim, MIX).softmax(-1)) @ v


def test_a5_a_mask_shared_by_the_heads_survives_the_mix() -> None:
    net, s, warned = run(core_talking_heads_after_a_shared_mask, grads=False)
    assert not warned, warned
    for name, block in zip(s.sites, net.blocks):
        q, k = block.raw
        mixed = torch.einsum("bhij,hg->bgij", q @ k.transpose(-1, -2), MIX.double())
        valid = block.valid.expand(B, H, L, L)
        assert s.info(name)["scale"] == pytest.approx(S0)
        np.testing.assert_allclose(s.value(name, "logit_var", "unscaled"), _pooled_var(mixed, valid), rtol=1e-4)
        np.testing.assert_allclose(s.value(name, "entropy"), entropy_ref(block.probs, block.valid), rtol=1e-5,
                                   atol=1e-6)


def test_a5_a_mix_probe_cannot_describe_is_reported_at_actual_with_a_warning() -> None:
    net, s, warned = run(core_talking_heads_masked, grads=False)
    assert s.info("blocks.0")["scale"] is None
    assert any("blocks.0" in w and "`actual` only" in w for w in warned), warned


# -- D: probabilities changed after the softmax (DeepViT's re-attention) ------------------------------
def core_reattention(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    p = keep(m, (q @ k.transpose(-1, -2) * S0).softmax(-1))
    p = torch.einsum("bhij,hg->bgij", p, torch.eye(H) + 0.1)  # re-attention: heads mixed after the softmax
    p = F.layer_norm(p.permute(0, 2, 3, 1), (H,)).permute(0, 3, 1, 2)  # ... then normalised over the heads
    return p @ v


def test_d_reattention_norm_over_heads_keeps_grad_v() -> None:
    net, s, warned = run(core_reattention)
    check(net, s, S0)
    assert not warned, warned


def core_lost_probs(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    p = keep(m, (q @ k.transpose(-1, -2) * S0).softmax(-1))
    return p.sqrt() @ v  # an op probe does not follow: v is not found


def test_d_probabilities_lost_after_the_softmax_warn_that_grad_v_is_missing() -> None:
    net, s, warned = run(core_lost_probs)
    check(net, s, S0, grads=False)
    assert "grad_v" not in s.metrics("blocks.0")
    assert any("blocks.0" in w and "grad_v is not measured" in w for w in warned), warned


# -- scores or a prescaled q changed in place by indexing ----------------------------------------------
def core_setitem_scores(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    scores = q @ k.transpose(-1, -2) * S0
    scores[..., -1] = 0.0  # in place: the record must not describe the scores before this
    return keep(m, scores.softmax(-1)) @ v


def core_setitem_mask(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    scores = q @ k.transpose(-1, -2) * S0
    scores[..., -1] = -1e9  # a mask fill written in place
    return keep(m, scores.softmax(-1)) @ v


def test_a_mask_written_in_place_keeps_the_record() -> None:
    net, s, warned = run(core_setitem_mask)
    check(net, s, S0)
    assert not warned, warned


def test_scores_set_in_place_are_not_described_by_a_stale_record() -> None:
    net, s, warned = run(core_setitem_scores, grads=False)
    assert s.info("blocks.0")["scale"] is None  # reported at `actual`, from the softmax input
    assert any("blocks.0" in w and "`actual` only" in w for w in warned), warned
    np.testing.assert_allclose(s.value("blocks.0", "max_prob"),
                               net.blocks[0].probs.detach().double().amax(-1).mean((0, 2)).numpy(), rtol=1e-5)


def core_setitem_q(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    qs = q * S0
    qs[..., 0] = 0.0  # in place after the factor: qs is no longer q * S0, its record is dropped
    m.raw = (qs.detach().double(), k.detach().double())
    return keep(m, (qs @ k.transpose(-1, -2)).softmax(-1)) @ v


def test_prescaled_q_set_in_place_makes_the_scale_unknown() -> None:
    # qs is no longer q * S0 (a stale record would measure q * S0 unzeroed), nor features of scale
    # 1: `actual` exact from the model's own qs, the scale not attributed, one warning
    net, s, warned = run(core_setitem_q, grads=False)
    for name, block in zip(s.sites, net.blocks):
        assert s.info(name)["scale"] is None
        np.testing.assert_allclose(s.value(name, "entropy"), entropy_ref(block.probs), rtol=1e-5, atol=1e-6)
        assert any(name in w and "`actual` only" in w for w in warned), warned


# -- multi-query einsum with one k / v head ("bhid,bjd->bhij", x-transformers' one_kv_head) -------------
def core_mqa_einsum(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    k1, v1 = k[:, 0], v[:, 0]  # (B, S, d): no head dim
    m.raw = (q.detach().double(), k1.unsqueeze(1).expand(B, H, L, D).detach().double())
    p = keep(m, (torch.einsum("bhid,bjd->bhij", q, k1) * S0).softmax(-1))
    p = F.conv2d(p, torch.eye(H).view(H, H, 1, 1))  # heads mixed after the softmax: still P on its way to v
    return torch.einsum("bhij,bjd->bhid", p, v1)


def test_d_multi_query_einsum_without_a_head_dim() -> None:
    net, s, warned = run(core_mqa_einsum)
    check(net, s, S0)
    assert s.info("blocks.0")["kv_heads"] == 1
    assert not warned, warned


# -- scores written back in place with relative positions added (timm MViTv2) -------------------------
def core_mvit_rel_pos(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    # L = 5: a class token and a 2x2 grid; the grid part of the scores gets rel_h + rel_w in place
    attn = (q * S0) @ k.transpose(-2, -1)
    r_q = q[:, :, 1:].reshape(B, H, 2, 2, D)
    rel_h = torch.einsum("byhwc,hkc->byhwk", r_q, torch.linspace(-1, 1, 2 * 2 * D).view(2, 2, D))
    rel_w = torch.einsum("byhwc,wkc->byhwk", r_q, torch.linspace(1, -1, 2 * 2 * D).view(2, 2, D))
    attn[:, :, 1:, 1:] = (attn[:, :, 1:, 1:].view(B, -1, 2, 2, 2, 2) + rel_h.unsqueeze(-1)
                          + rel_w.unsqueeze(-2)).view(B, -1, 4, 4)
    m.valid = torch.ones(1, 1, L, L, dtype=torch.bool)
    return keep(m, attn.softmax(-1)) @ v


def test_scores_written_back_with_relative_positions_keep_their_scale() -> None:
    # the write is a bias that does not scale with σ: actual exact, the scale the model's own
    net, s, warned = run(core_mvit_rel_pos)
    assert not warned, warned
    for name, block in zip(s.sites, net.blocks):
        assert s.info(name)["scale"] == pytest.approx(S0)
        np.testing.assert_allclose(s.value(name, "entropy"), entropy_ref(block.probs, block.valid), rtol=1e-5)
        np.testing.assert_allclose(s.value(name, "max_prob"),
                                   block.probs.detach().double().amax(-1).mean((0, 2)).numpy(), rtol=1e-5)
        for g in ("grad_q", "grad_k", "grad_v"):
            assert g in s.metrics(name)


def test_c_learned_factor_then_transposed_keeps_where_it_came_from() -> None:
    """A learnable scalar on q (a Parameter) before a transpose: the scale and its source survive
    the transpose, and reading the factor for ``scale_from`` warns nothing in the user's run."""

    class Learned(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(H * D, 3 * H * D)
            self.gain = nn.Parameter(torch.tensor(0.5))

        def forward(self, x: Tensor) -> Tensor:
            b, n, _ = x.shape
            q, k, v = self.proj(x).view(b, n, 3, H, D).unbind(2)
            q, k, v = ((q * self.gain).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    model = Learned()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with probe.watch(model) as p:
            model(torch.randn(B, L, H * D)).sum().backward()
    info = p.summary().info("root")
    assert info["scale"] == pytest.approx(0.5)
    assert info["scale_from"] == "q multiplied by 0.5 before q·kᵀ"


# -- issue 25: spellings that were silently wrong --------------------------------------------------------
def core_k_factor_einsum(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    k = k * S0  # the factor on k, then a product that permutes it: einsum
    return keep(m, torch.einsum("bhid,bhjd->bhij", q, k).softmax(-1)) @ v


def core_k_factor_mT(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    k = k / S0 ** -1  # divided, then transposed by the `mT` property
    return keep(m, torch.matmul(q, k.mT).softmax(-1)) @ v


def core_k_factor_5d(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    q5, k5, v5 = (t.unsqueeze(1) for t in (q, k, v))
    k5 = k5 * S0
    return (keep(m, torch.einsum("bthid,bthjd->bthij", q5, k5).softmax(-1)) @ v5).squeeze(1)


def core_q_mul_inplace(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    q = q.contiguous()
    q.mul_(S0)  # in place on a fresh q
    return keep(m, (q @ k.transpose(-1, -2)).softmax(-1)) @ v


def core_q_imul(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    q = q.clone()
    q *= S0
    return keep(m, (q @ k.transpose(-1, -2)).softmax(-1)) @ v


def core_k_div_inplace_sdpa(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    k = k.clone()
    k.div_(S0 ** -1)
    return F.scaled_dot_product_attention(q, k, v, scale=1.0)


@pytest.mark.parametrize("core", [core_k_factor_einsum, core_k_factor_mT, core_k_factor_5d, core_q_mul_inplace,
                                  core_q_imul, core_k_div_inplace_sdpa],
                         ids=["k-einsum", "k-mT", "k-5d", "q-mul_", "q-imul", "k-div_-sdpa"])
def test_factor_on_k_or_in_place_is_the_scale(core) -> None:
    net, s, warned = run(core)
    check(net, s, S0)
    assert not warned, warned


def core_swin_inner_mask(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    # Swin's shifted windows: a relative position bias, then a mask of -100 built inside the function
    bias = torch.linspace(0.5, 3.0, H * L * L).view(H, L, L)  # positive where keys are masked, too
    mask = q.new_zeros(L, L)
    mask[: L // 2, L // 2:] = -100.0
    mask = mask.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(L - 1).flip(0), -100.0)
    attn = q @ k.transpose(-2, -1) * S0 + bias
    attn = attn + mask
    m.valid = (mask > -100).expand(1, 1, L, L)
    return keep(m, attn.softmax(-1)) @ v


def test_a_mask_added_after_a_bias_masks_its_keys() -> None:
    net, s, warned = run(core_swin_inner_mask)
    check(net, s, S0)
    assert not warned, warned


def _mask_pad_and_causal() -> Tensor:
    """Valid keys: causal from the third row on, the first two rows see keys 0, 1 (every row has
    at least two valid keys, so the reference's mean over rows is probe's)."""
    keep = torch.ones(L, L, dtype=torch.bool).tril()
    keep[:2, :2] = True
    return keep


def core_where_shifted(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    # keras.layers.Attention's mask: the masked entries are the scores shifted by -1e9, not a fill
    causal = _mask_pad_and_causal()
    m.valid = causal.expand(1, 1, L, L)
    s = q @ k.transpose(-1, -2) * S0
    return keep(m, torch.where(~causal, s - torch.tensor(1e9), s).softmax(-1)) @ v


def core_where_shifted_second(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    causal = _mask_pad_and_causal()
    m.valid = causal.expand(1, 1, L, L)
    s = q @ k.transpose(-1, -2) * S0
    return keep(m, torch.where(causal, s, s + -1e9).softmax(-1)) @ v


@pytest.mark.parametrize("core", [core_where_shifted, core_where_shifted_second], ids=["shifted-first", "shifted-second"])
def test_where_between_the_scores_and_the_scores_shifted_far_down_is_a_mask(core) -> None:
    # was: "`where` between the scores and another function of them", measured from the softmax
    # input with every key valid: logit_var 2.4e17 (the -1e9 entries), entropy over log(all keys),
    # and the site verified (its own softmax input reproduces its probabilities)
    net, s, warned = run(core)
    check(net, s, S0)
    assert not any("could not be recovered" in w for w in warned), warned


def core_where_shifted_up(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    s = q @ k.transpose(-1, -2) * S0
    return keep(m, torch.where(~causal, s + 5.0, s).softmax(-1)) @ v


def test_where_with_a_small_shift_is_not_a_mask_and_is_named() -> None:
    _, s, warned = run(core_where_shifted_up)
    assert all(s.info(site)["verified"] is False for site in s.sites)
    assert any("UNVERIFIED" in w for w in warned), warned


def core_einsum_k_first(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    # Keras' MultiHeadAttention (its eager path): (B, T, N, H) layouts, k the first operand
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    s = torch.einsum("aecd,abcd->acbe", k, q * S0)
    return torch.einsum("acbe,aecd->abcd", keep(m, s.softmax(-1)), v).transpose(1, 2)


def test_einsum_with_k_as_its_first_operand_is_q_k() -> None:
    # was: "`einsum` of (2, 5, 2, 4) × (2, 5, 2, 4) was not taken as q·kᵀ": NOT measured
    net, s, warned = run(core_einsum_k_first)
    check(net, s, S0)
    assert not any("NOT measured" in w for w in warned), warned


def core_lse(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    s = q @ k.transpose(-1, -2) * S0
    return keep(m, torch.exp(s - torch.logsumexp(s, -1, keepdim=True))) @ v


def core_exp_sum(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    s = q @ k.transpose(-1, -2) * S0
    e = s.exp()
    return keep(m, e / e.sum(-1, keepdim=True)) @ v


def core_exp_max_sum(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    pad = torch.zeros(L, L, dtype=torch.bool)
    pad[:, -1] = True  # the last key masked (by -inf: its exp is 0)
    s = (q @ k.transpose(-1, -2) * S0).masked_fill(pad, float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True).detach())
    m.valid = (~pad).expand(1, 1, L, L)
    return keep(m, e / e.sum(dim=-1, keepdim=True)) @ v


def core_log_softmax_exp(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    s = q @ k.transpose(-1, -2) * S0
    return keep(m, F.log_softmax(s, dim=-1).exp()) @ v


@pytest.mark.parametrize("core", [core_lse, core_exp_sum, core_exp_max_sum, core_log_softmax_exp],
                         ids=["exp-lse", "exp-sum", "exp-max-sum", "log_softmax-exp"])
def test_softmax_spelled_out(core) -> None:
    net, s, warned = run(core)
    check(net, s, S0)
    assert not warned, warned
    report = probe.coverage(Net(core), torch.randn(B, L, H * D))
    assert not report.missed and [r.site for r in report.rows] == ["blocks.0", "blocks.1"]


def core_lse_lost(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    s = (q @ k.transpose(-1, -2) * S0).flatten(2).unflatten(2, (L, L))  # capture cannot tell the keys here
    e = s.exp()
    return keep(m, e / e.sum(-1, keepdim=True)) @ v


def test_a_spelled_softmax_capture_misses_is_named_by_the_audit() -> None:
    net, s, warned = run(core_lse_lost, grads=False)
    assert s.sites == []
    assert any("'blocks.0' is NOT measured" in w and "`flatten`" in w for w in warned), warned


class Folded(nn.Module):
    """qkv reshaped to ``(3, B·H, L, d)`` and unbound (heads folded into the batch)."""

    def __init__(self, declare: bool = True, seen: bool = True) -> None:
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)
        if declare:
            self.num_heads = H
        self.seen = seen
        self.probs: Optional[Tensor] = None

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, H, D).permute(2, 0, 3, 1, 4)
        if self.seen:
            q, k, v = qkv.reshape(3, b * H, n, D).unbind(0)
        else:  # the merge happens where probe cannot see it (a contiguous copy made in numpy)
            flat = torch.from_numpy(qkv.detach().numpy().reshape(3, b * H, n, D).copy()).requires_grad_()
            q, k, v = flat.unbind(0)
        self.raw = (q.detach().double().view(b, H, n, D), k.detach().double().view(b, H, n, D))
        p = (q @ k.transpose(-1, -2) * S0).softmax(-1)
        self.probs = p
        return (p @ v).view(b, H, n, D)


@pytest.mark.parametrize("seen", [True, False], ids=["merge-seen", "declared"])
def test_heads_folded_into_the_batch_are_recovered(seen) -> None:
    torch.manual_seed(0)
    model = Folded(seen=seen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model) as p:
            model(torch.randn(B, L, H * D))
    s = p.summary()
    assert s.info("root")["heads"] == H
    np.testing.assert_allclose(s.value("root", "entropy"), entropy_ref(model.probs), rtol=1e-5, atol=1e-6)
    q, k = model.raw
    np.testing.assert_allclose(s.value("root", "logit_var", "unscaled"),
                               _pooled_var(q @ k.transpose(-1, -2), torch.ones(B, H, L, L, dtype=torch.bool)), rtol=1e-4)
    said = [str(w.message) for w in caught if "folded into the batch" in str(w.message)]
    assert bool(said) == (not seen), said  # a guess from the declared count is named


def test_heads_folded_without_a_declaration_are_one_head_per_row_and_named() -> None:
    torch.manual_seed(0)
    model = Folded(declare=False, seen=False)
    with probe.watch(model) as p:
        model(torch.randn(B, L, H * D))
    assert p.summary().info("root")["heads"] == 1


class TalkingLinear(nn.Module):
    """Talking heads as ``nn.Linear`` over the heads of permuted scores, before and after the softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)
        self.pre, self.post = nn.Linear(H, H), nn.Linear(H, H, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, D).permute(2, 0, 3, 1, 4)
        self.raw = (q.detach().double(), k.detach().double())
        s = q @ k.transpose(-1, -2) * S0
        s = self.pre(s.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        self.z = s.detach().double()
        p = s.softmax(-1)
        self.probs = p
        p = self.post(p.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return p @ v


def test_talking_heads_as_a_linear_layer_over_the_heads() -> None:
    torch.manual_seed(0)
    model = TalkingLinear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model) as p:
            model(torch.randn(B, L, H * D)).sum().backward()
    assert not [w for w in caught if "probe" in str(w.message)], [str(w.message) for w in caught]
    s = p.summary()
    info = s.info("root")
    assert info["scale"] == pytest.approx(S0) and info["heads"] == H
    np.testing.assert_allclose(s.value("root", "entropy"), entropy_ref(model.probs), rtol=1e-5, atol=1e-6)
    # unscaled: the mix of the raw products, the linear layer's bias a bias (it does not scale with σ)
    q, k = model.raw
    w = model.pre.weight.detach().double()
    mixed = torch.einsum("bhij,gh->bgij", q @ k.transpose(-1, -2), w)
    np.testing.assert_allclose(s.value("root", "logit_var", "unscaled"),
                               _pooled_var(mixed, torch.ones(B, H, L, L, dtype=torch.bool)), rtol=1e-4)
    for g in ("grad_logits", "grad_q", "grad_k", "grad_v"):
        assert g in s.metrics("root")
    assert not probe.coverage(TalkingLinear(), torch.randn(B, L, H * D)).missed


def core_opaque_sdpa(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention((q * S0).clamp(-3.0, 3.0), k, v, scale=1.0)


def test_an_opaque_operand_of_sdpa_has_an_unknown_scale() -> None:
    net, s, warned = run(core_opaque_sdpa, grads=False)
    for name, block in zip(s.sites, net.blocks):
        info = s.info(name)
        assert info["scale"] is None and "`clamp`" in info["scale_unknown"], info
        q, k = block.raw
        probs = ((q * S0).clamp(-3.0, 3.0) @ k.transpose(-1, -2)).softmax(-1)
        np.testing.assert_allclose(s.value(name, "entropy"), entropy_ref(probs), rtol=1e-5, atol=1e-6)
        assert any(name in w and "`actual` only" in w for w in warned), warned


class HeadMajor(nn.Module):
    """attention-is-all-you-need-pytorch's (older) layout: heads first, folded head-major into
    the batch (row h·B + b), 3-D scores and masks repeated per head, heads unfolded after P·v."""

    def __init__(self) -> None:
        super().__init__()
        self.n_head = H
        self.w_qs, self.w_ks, self.w_vs = (nn.Linear(H * D, H * D) for _ in range(3))

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        b, n, _ = x.shape
        q, k, v = (w(x).view(b, n, H, D) for w in (self.w_qs, self.w_ks, self.w_vs))
        q, k, v = (t.permute(2, 0, 1, 3).contiguous().view(-1, n, D) for t in (q, k, v))  # (H·B, n, d)
        mask = pad[:, None, :].expand(b, n, n).repeat(H, 1, 1)  # head-major too
        attn = torch.bmm(q, k.transpose(1, 2)) / D ** 0.5
        attn = attn.masked_fill(mask, float("-inf"))
        attn = attn.softmax(-1)
        self.probs = attn.view(H, b, n, n).transpose(0, 1)
        self.raw = (q.view(H, b, n, D).transpose(0, 1).detach().double(),
                    k.view(H, b, n, D).transpose(0, 1).detach().double())
        out = torch.bmm(attn, v).view(H, b, n, D).permute(1, 2, 0, 3).reshape(b, n, H * D)
        return out


def test_heads_folded_head_major_are_recovered() -> None:
    torch.manual_seed(0)
    model = HeadMajor()
    x, pad = torch.randn(B, L, H * D), torch.zeros(B, L, dtype=torch.bool)
    pad[1, -1] = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model) as p:
            model(x, pad).sum().backward()
    assert not [str(w.message) for w in caught if "probe" in str(w.message)]
    s = p.summary()
    assert s.info("root")["heads"] == H and s.info("root")["scale"] == pytest.approx(S0)
    valid = (~pad)[:, None, None, :].expand(B, H, L, L)
    np.testing.assert_allclose(s.value("root", "entropy"), entropy_ref(model.probs, valid), rtol=1e-5, atol=1e-6)
    q, k = model.raw
    np.testing.assert_allclose(s.value("root", "logit_var", "unscaled"), _pooled_var(q @ k.transpose(-1, -2), valid),
                               rtol=1e-4)
    for g in ("grad_logits", "grad_q", "grad_k", "grad_v"):
        assert g in s.metrics("root")


def core_ellipsis_einsum(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    p = keep(m, (torch.einsum("...id,...jd->...ij", q * S0, k)).softmax(-1))
    return torch.einsum("...ij,...jd->...id", p, v)


def core_per_head_after_bias(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    gain = torch.tensor([0.5, 2.0]).view(1, H, 1, 1)
    bias = torch.linspace(-1.0, 1.0, L * L).view(L, L)
    m.raw = (q.detach().double() * gain.double() ** 0.5, k.detach().double() * gain.double() ** 0.5)
    return keep(m, ((q @ k.transpose(-1, -2) * S0 + bias) * gain).softmax(-1)) @ v


def test_einsum_with_an_ellipsis() -> None:
    net, s, warned = run(core_ellipsis_einsum)
    check(net, s, S0)
    assert not warned, warned


def test_a_per_head_factor_after_a_bias_scales_the_bias() -> None:
    net, s, warned = run(core_per_head_after_bias, grads=False)
    assert not warned, warned
    for name, block in zip(s.sites, net.blocks):
        assert s.info(name)["scale"] == pytest.approx([S0 * 0.5, S0 * 2.0])
        np.testing.assert_allclose(s.value(name, "entropy"), entropy_ref(block.probs), rtol=1e-5, atol=1e-6)


POS = torch.linspace(-1.0, 1.0, L * D).view(L, D)  # a position table (a constant)


def core_position_product_as_bias(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    # DeBERTa: q·posᵀ gathered per relative position, divided by its own factor, added: a bias
    c2p = torch.gather(q @ POS.t().expand(B, H, D, L), -1, torch.arange(L).flip(0).expand(B, H, L, L).contiguous())
    scores = torch.matmul(q, (k / (3 * D) ** 0.5).transpose(-1, -2)) + c2p / (3 * D) ** 0.5
    m.bias = (c2p / (3 * D) ** 0.5).detach().double()
    return keep(m, scores.softmax(-1)) @ v


def core_position_product_with_the_factor(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    # Funnel: the positional term is a product with the pre-scaled q: it scales with σ, never a fixed bias
    q = q * S0
    pos = torch.gather(q @ POS.t().expand(B, H, D, L), -1, torch.arange(L).flip(0).expand(B, H, L, L).contiguous())
    return keep(m, (q @ k.transpose(-1, -2) + pos).softmax(-1)) @ v


def test_a_product_with_positions_is_a_bias_unless_it_carries_the_factor() -> None:
    net, s, warned = run(core_position_product_as_bias, grads=False)
    assert not warned, warned
    check(net, s, 1 / math.sqrt(3 * D), grads=False)
    net, s, warned = run(core_position_product_with_the_factor, grads=False)
    for name, block in zip(s.sites, net.blocks):
        assert s.info(name)["scale"] is None and "with the model's factor" in s.info(name)["scale_unknown"]
        np.testing.assert_allclose(s.value(name, "entropy"), entropy_ref(block.probs), rtol=1e-5, atol=1e-6)
        assert any(name in w and "`actual` only" in w for w in warned), warned


# -- patterns met in third-party code (TransformerLens, x-transformers, vit-pytorch's RvT) --------------
def core_nan_cleaned_probs(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    p = keep(m, F.softmax(q @ k.transpose(-1, -2) / D ** 0.5, dim=-1))
    p = torch.where(torch.isnan(p), torch.zeros_like(p), p)  # TransformerLens
    return p.masked_fill(torch.zeros(L, L, dtype=torch.bool), 0.0) @ v


def test_probabilities_cleaned_after_the_softmax_still_meet_v() -> None:
    net, s, warned = run(core_nan_cleaned_probs)
    check(net, s, S0)
    assert not warned, warned


def core_attention_sink(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    sim = q @ k.transpose(-1, -2) * S0
    sink = torch.full((B, H, L, 1), 0.5)  # a learned logit per head (x-transformers' head_attn_sink)
    p = torch.cat((sink, sim), dim=-1).softmax(-1)
    m.z = torch.cat((sink, sim), dim=-1).detach().double()
    return p[..., 1:] @ v


def test_scores_joined_with_a_sink_are_measured_at_actual() -> None:
    net, s, warned = run(core_attention_sink, grads=False)
    # (over zip(s.sites, ...) alone this passed with no site measured: the logits path took its
    # width from k's S keys, the sink's logits have S + 1, and each site's statistics failed)
    assert s.sites == ["blocks.0", "blocks.1"], warned
    assert not any("NOT measured" in w for w in warned), warned
    for name, block in zip(s.sites, net.blocks):
        assert s.info(name)["scale"] is None and "sink" in s.info(name)["scale_unknown"]
        np.testing.assert_allclose(s.value(name, "entropy"), entropy_ref(block.z.softmax(-1)), rtol=1e-5, atol=1e-6)
        assert any(name in w and "`actual` only" in w for w in warned), warned


def core_cdist(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return (-torch.cdist(q, k) ** 2 * S0).softmax(-1) @ v  # x-transformers' l2 distance attention


def test_a_softmax_over_distances_is_named_by_the_audit() -> None:
    net, s, warned = run(core_cdist, grads=False)
    assert s.sites == []
    assert any("'blocks.0' is NOT measured" in w and "`cdist`" in w for w in warned), warned


def core_rotary_on_folded_heads(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    # vit-pytorch's RvT: heads folded into the batch, the class token split off, a rotary embedding
    # written out (reshape to pairs, unbind, stack), joined back: the fold is not carried by the records
    q, k, v = (t.reshape(B * H, L, D) for t in (q, k, v))

    def rot(t: Tensor) -> Tensor:
        x1, x2 = t.reshape(*t.shape[:-1], D // 2, 2).unbind(-1)
        cos, sin = torch.linspace(0.5, 1.0, D), torch.linspace(0.1, 0.6, D)  # vary along the features
        return t * cos + torch.stack((-x2, x1), -1).reshape(t.shape) * sin

    (qc, qr), (kc, kr) = ((t[:, :1], t[:, 1:]) for t in (q, k))
    q, k = torch.cat((qc, rot(qr)), 1), torch.cat((kc, rot(kr)), 1)
    m.raw = (q.view(B, H, L, D).detach().double(), k.view(B, H, L, D).detach().double())
    p = keep(m, torch.einsum("bid,bjd->bij", q, k).mul(S0).softmax(-1))
    return torch.einsum("bij,bjd->bid", p, v).view(B, H, L, D)


def test_heads_folded_in_the_module_are_recovered_after_a_rotary() -> None:
    net, s, warned = run(core_rotary_on_folded_heads)  # no declared head count: the fold seen decides
    check(net, s, S0)
    assert not warned, warned


def core_zero_head_bias(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    # a per-head constant (here zero: timm CaiT's talking-heads nn.Linear bias at init) added to the scores
    return keep(m, (q @ k.transpose(-1, -2) * S0 + torch.zeros(1, H, 1, 1)).softmax(-1)) @ v


def test_a_per_head_constant_bias_is_measured() -> None:
    net, s, warned = run(core_zero_head_bias)
    check(net, s, S0)
    assert not warned, warned


def core_landmarks(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    # Nyströmformer: q and k scaled, then means of segments (landmarks): still the same factor
    qs, ks = q / D ** 0.25, k / D ** 0.25
    k_land = torch.cat((ks, ks[:, :, :1]), 2).reshape(B, H, 2, (L + 1) // 2, D).mean(dim=-2)
    m.raw = (q.detach().double(), torch.cat((k, k[:, :, :1]), 2).reshape(B, H, 2, (L + 1) // 2, D).mean(-2).detach()
             .double())
    p = keep(m, (qs @ k_land.transpose(-1, -2)).softmax(-1))
    return p @ v[:, :, :2]


def test_means_of_a_scaled_operand_keep_its_factor() -> None:
    net, s, warned = run(core_landmarks)
    check(net, s, S0)
    assert not warned, warned


def core_renormalised_in_place(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    # timm ConViT: a gated mix with positional attention, renormalised in place
    p = keep(m, (q @ k.transpose(-1, -2) * S0).softmax(-1))
    pos = torch.linspace(0, 1, L * L).view(1, 1, L, L).expand(B, H, L, L).softmax(-1)
    attn = 0.7 * p + 0.3 * pos
    attn /= attn.sum(dim=-1).unsqueeze(-1)
    return attn @ v


def test_probabilities_renormalised_in_place_still_meet_v() -> None:
    net, s, warned = run(core_renormalised_in_place)
    check(net, s, S0)
    assert not warned, warned


class SequenceFirst(nn.Module):
    """fairseq's multi-head attention: (T, B, E) inputs, q scaled in place, heads split from the
    features and folded into the batch by one view, then the sequence transposed behind them."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = H
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(H * D, H * D) for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        t, b, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q *= D ** -0.5
        q, k, v = (u.contiguous().view(t, b * H, D).transpose(0, 1) for u in (q, k, v))
        self.raw = ((q / S0).view(b, H, t, D).detach().double(), k.view(b, H, t, D).detach().double())
        p = torch.bmm(q, k.transpose(1, 2)).softmax(-1)
        self.probs = p.view(b, H, t, t)
        return torch.bmm(p, v).transpose(0, 1).contiguous().view(t, b, H * D)


def test_heads_split_and_folded_sequence_first_are_recovered() -> None:
    torch.manual_seed(0)
    model = SequenceFirst()
    self_warned = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model) as p:
            model(torch.randn(L, B, H * D)).sum().backward()
        self_warned = [str(w.message) for w in caught if "probe" in str(w.message)]
    assert not self_warned, self_warned
    s = p.summary()
    assert s.info("root")["heads"] == H and s.info("root")["scale"] == pytest.approx(S0)
    np.testing.assert_allclose(s.value("root", "entropy"), entropy_ref(model.probs), rtol=1e-5, atol=1e-6)
    q, k = model.raw
    np.testing.assert_allclose(s.value("root", "logit_var", "unscaled"),
                               _pooled_var(q @ k.transpose(-1, -2), torch.ones(B, H, L, L, dtype=torch.bool)), rtol=1e-4)


class Sliced(nn.Module):
    """diffusers' SlicedAttnProcessor: the B·H rows attended a slice at a time, the fold unseen."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = 2 * H  # declared; the slices below hold fewer rows
        self.qkv = nn.Linear(H * D, 3 * H * D)

    def forward(self, x: Tensor) -> Tensor:
        rows = torch.from_numpy(self.qkv(x).detach().numpy().reshape(B * H, L, 3 * D).copy())
        q, k, v = rows.split(D, -1)
        out = [(q[i:i + 2] @ k[i:i + 2].transpose(1, 2) * S0).softmax(-1) @ v[i:i + 2] for i in range(0, B * H, 2)]
        return torch.cat(out)


def test_a_slice_of_the_folded_rows_is_named() -> None:
    model = Sliced()
    with pytest.warns(RuntimeWarning, match="not a multiple: reported as one head per row"):
        with probe.watch(model):
            model(torch.randn(B, L, H * D))


class LocalWindows(nn.Module):
    """local-attention's layout: heads folded into the batch, the sequence cut into windows that
    attend to themselves and the window before (causal), padded with -inf keys at the start."""

    def __init__(self, heads: int = 2, window: int = 3) -> None:
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv = nn.Linear(16, 3 * 16)

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        h, w, d = self.heads, self.window, 16 // self.heads
        q, k, v = (t.reshape(b, n, h, d).transpose(1, 2).reshape(b * h, n, d) for t in self.qkv(x).chunk(3, -1))
        q = q * d ** -0.5
        bq, bk, bv = (t.reshape(b * h, n // w, w, d) for t in (q, k, v))
        pad = lambda t: torch.cat((torch.zeros_like(t[:, :1]), t[:, :-1]), 1)  # noqa: E731 - the previous window
        bk, bv = torch.cat((pad(bk), bk), 2), torch.cat((pad(bv), bv), 2)  # (B·H, W, 2w, d)
        i = torch.arange(w)[:, None] + w
        j = torch.arange(2 * w)[None, :]
        mask = (j > i).expand(n // w, w, 2 * w).clone()
        mask[0, :, :w] = True  # no window before the first
        sim = torch.einsum("bwid,bwjd->bwij", bq, bk).masked_fill(mask, float("-inf"))
        p = sim.softmax(-1)
        self.probs = p.reshape(b, h, n // w, w, 2 * w).transpose(1, 2).reshape(-1, h, w, 2 * w)
        self.valid = ~mask.expand(b, n // w, w, 2 * w).reshape(-1, 1, w, 2 * w)
        out = torch.einsum("bwij,bwjd->bwid", p, bv).reshape(b, h, n, d)
        return out.transpose(1, 2).reshape(b, n, 16)


def test_windows_after_a_fold_are_measured_per_head() -> None:
    torch.manual_seed(0)
    model = LocalWindows()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model) as p:
            model(torch.randn(2, 12, 16)).sum().backward()
    said = [str(w.message) for w in caught if "probe" in str(w.message)]
    assert not said, said
    s = p.summary()
    assert s.info("root")["heads"] == 2 and s.info("root")["scale"] == pytest.approx(8 ** -0.5)
    probs, valid = model.probs.detach().double(), model.valid.expand_as(model.probs)
    n = valid.sum(-1)
    ent = -(torch.where(valid, probs * probs.clamp_min(1e-300).log(), torch.zeros_like(probs))).sum(-1)
    ent = ent / n.clamp(min=2).double().log()
    rows = n >= 2
    want = ((ent * rows).sum((0, 2)) / rows.sum((0, 2))).numpy()
    np.testing.assert_allclose(s.value("root", "entropy"), want, rtol=1e-5, atol=1e-6)
    for g in ("grad_logits", "grad_q", "grad_k", "grad_v"):
        assert g in s.metrics("root")


def core_kv_from_a_viewed_weight(m: Attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    # CoLT5: k computed by an einsum with a view of a parameter: a projection, not scores
    w = m.out.weight.view(H, D, H, D)[:, :, 0]  # (H, D, D) view of a Parameter
    k2 = torch.einsum("hde,bhne->bhnd", w, k * 3.0)  # a factor before the projection is absorbed
    m.raw = (q.detach().double(), k2.detach().double())
    return keep(m, (q * S0 @ k2.transpose(-1, -2)).softmax(-1)) @ v


def test_a_product_with_a_view_of_a_weight_is_a_projection() -> None:
    net, s, warned = run(core_kv_from_a_viewed_weight)
    check(net, s, S0)
    assert not warned, warned
