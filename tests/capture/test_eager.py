"""Eager attention capture: every written-out softmax(q·kᵀ·s + bias) pattern against float64."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import _get_current_function_mode_stack

import probe
from probe.capture.eager import EagerFrontEnd
from tests.capture.timm_style import TinyViT
from tests.helpers import reference_metrics

B, H, L, D = 2, 4, 6, 8
METRICS = ("logit_var", "logit_max", "entropy", "max_prob", "saturation")


class Eager(nn.Module):
    """One attention computation written out in the style named by ``style``; it stores the
    q, k, scale, valid mask and bias the computation really used in ``self.seen``."""

    def __init__(self, style: str, softcap: float = 5.0) -> None:
        super().__init__()
        self.style, self.softcap = style, softcap
        self.qkv = nn.Linear(D * H, 3 * D * H)
        self.head_scale = nn.Parameter(torch.linspace(0.2, 0.5, H))
        nn.init.normal_(self.qkv.weight, std=0.6)
        self.register_buffer("tril", torch.ones(L, L).tril().view(1, 1, L, L))
        self.register_buffer("pos_bias", torch.randn(1, H, L, L))
        self.register_buffer("alibi", torch.randn(B * H, 1, L))
        self.seen: dict = {}

    def _keep(self, z: torch.Tensor) -> torch.Tensor:
        """The softmax input, kept with its gradient (the reference for grad_logits)."""
        if z.requires_grad:
            z.retain_grad()
        self.z = z
        return z

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        s = D ** -0.5
        add = torch.zeros(B, 1, 1, L, device=x.device).masked_fill(~pad[:, None, None, :], torch.finfo(torch.float32).min)
        causal = self.tril.bool()
        full = torch.ones(B, H, L, L, dtype=torch.bool, device=x.device)
        seen = dict(q=q, k=k, scale=s, valid=full & pad[:, None, None, :], bias=None, softcap=None)
        style = self.style
        if style == "hf":  # Llama / BERT / GPT-2 in transformers 5
            att = torch.matmul(q, k.transpose(2, 3)) * s
            att = att + add
            att = self._keep(att)
            att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
        elif style == "gpt2_full":  # GPT-2 before transformers 4.4x: / torch.full([], sqrt(d)), where(...)
            att = torch.matmul(q, k.transpose(-1, -2))
            att = att / torch.full([], v.size(-1) ** 0.5, dtype=att.dtype, device=x.device)
            att = torch.where(causal, att, torch.full([], torch.finfo(att.dtype).min, device=x.device))
            att = self._keep(att)
            att = nn.functional.softmax(att, dim=-1)
            seen["valid"] = full & causal
        elif style == "nanogpt":
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.tril[:, :, :L, :L] == 0, float("-inf"))
            att = self._keep(att)
            att = F.softmax(att, dim=-1)
            seen["valid"] = full & causal
        elif style == "t5_inplace":  # scores += position_bias, scale 1
            bias = self.pos_bias
            att = torch.matmul(q, k.transpose(3, 2))
            att += bias
            att = att + add
            att = self._keep(att.float())
            att = torch.softmax(att, dim=-1).type_as(att)
            seen.update(scale=1.0, bias=bias)
        elif style == "flat_rows":  # q scaled on its (B·L, H·D) rows before the heads are split (fairseq-like)
            rows = self.qkv(x).reshape(B * L, 3 * H * D)[:, : H * D] * s
            q = rows.view(B, L, H, D).transpose(1, 2)
            att = self._keep(q @ k.transpose(-2, -1)).softmax(-1)
            seen["valid"] = full
        elif style == "timm":
            q = q * s
            att = q @ k.transpose(-2, -1)
            att = self._keep(att)
            att = att.softmax(dim=-1)
            seen["valid"] = full
        elif style == "bmm":  # (B*H, L, d) layout: heads recovered from the reshape
            att = torch.bmm(q.reshape(B * H, L, D), k.reshape(B * H, L, D).transpose(1, 2)) / math.sqrt(D)
            att = att.view(B, H, L, L) + add
            att = self._keep(att.view(B * H, L, L))
            att = att.softmax(-1)
            seen["valid"] = full & pad[:, None, None, :]
        elif style == "baddbmm":  # Bloom-style alibi: baddbmm(bias, q, kᵀ, beta=1, alpha=s)
            alibi = self.alibi
            att = torch.baddbmm(alibi, q.reshape(B * H, L, D), k.reshape(B * H, L, D).transpose(1, 2), beta=1.0, alpha=s)
            att = self._keep(att)
            att = att.view(B, H, L, L).softmax(-1)
            seen.update(valid=full, bias=alibi.view(B, H, 1, L))
        elif style == "einsum":
            att = torch.einsum("bhqd,bhkd->bhqk", q, k) * s
            att = att.masked_fill(~pad[:, None, None, :], -1e9)
            att = self._keep(att)
            att = att.softmax(-1)
        elif style == "einsum_blhd":
            att = torch.einsum("bqhd,bkhd->bhqk", q.transpose(1, 2), k.transpose(1, 2)) * s
            att = self._keep(att)
            att = torch.softmax(att, -1)
            seen["valid"] = full
        elif style == "softcap":  # Gemma 2
            att = torch.matmul(q, k.transpose(2, 3)) * s
            att = att / self.softcap
            att = torch.tanh(att)
            att = att * self.softcap
            att = att + add
            att = self._keep(att)
            att = F.softmax(att, dim=-1, dtype=torch.float32)
            seen["softcap"] = self.softcap
        elif style == "shifted":  # a row-max shift for stability is an additive bias
            att = torch.matmul(q, k.transpose(-1, -2)) * s + add
            shift = att.amax(-1, keepdim=True).detach()
            att = att - shift
            att = self._keep(att)
            att = att.softmax(-1)
            seen["bias"] = add - shift
        elif style == "per_head":
            att = torch.matmul(q, k.transpose(-1, -2)) * self.head_scale.view(1, H, 1, 1)
            att = self._keep(att)
            att = att.softmax(-1)
            seen.update(valid=full, scale=self.head_scale.detach())
        elif style == "manual_pv":
            att = torch.matmul(q, k.transpose(-1, -2)) * s + add
            att = self._keep(att)
            att = att.softmax(-1)
        elif style == "unknown":  # a clamp the record cannot describe
            att = (torch.matmul(q, k.transpose(-1, -2)) * s).clamp(max=1e4) + add
            seen["logits"] = att
            att = self._keep(att)
            att = att.softmax(-1)
        else:
            raise ValueError(style)
        self.seen = seen
        if style.startswith("einsum"):
            out = torch.einsum("bhqk,bhkd->bhqd", att, v)
        elif style == "manual_pv":  # P never meets a product with v
            out = (att.unsqueeze(-1) * v.unsqueeze(-3)).sum(-2)
        else:
            out = att.reshape(B, H, L, L) @ v
        return out.transpose(1, 2).reshape(B, L, H * D)


def _batch():
    torch.manual_seed(1)
    x = torch.randn(B, L, D * H)
    pad = torch.ones(B, L, dtype=torch.bool)
    pad[1, -2:] = False
    return x, pad


def _reference(seen: dict, scale=None) -> dict:
    s = seen["scale"] if scale is None else scale
    q, k = seen["q"], seen["k"]
    if isinstance(s, torch.Tensor):  # per head: fold the scale into q
        q = q * s.view(1, -1, 1, 1)
        s = 1.0
    return reference_metrics(q, k, s, seen["valid"], seen["bias"], softcap=seen["softcap"])


STYLES = ["hf", "gpt2_full", "nanogpt", "t5_inplace", "timm", "bmm", "baddbmm", "einsum", "einsum_blhd",
          "softcap", "shifted", "per_head", "flat_rows"]


@pytest.mark.parametrize("style", STYLES)
def test_pattern_matches_float64_reference(style):
    model = Eager(style)
    x, pad = _batch()
    ref_out = model(x, pad)
    with probe.watch(model) as p:
        out = model(x, pad)
    assert torch.equal(out, ref_out)  # the model computes exactly what it did without probe
    s = p.summary()
    assert s.sites == ["root"]
    info = s.info("root")
    assert info["kind"] == "eager" and info["heads"] == H and info["d_k"] == D
    seen = model.seen
    if isinstance(seen["scale"], torch.Tensor):
        np.testing.assert_allclose(info["scale"], seen["scale"].numpy(), rtol=1e-6)
    else:
        np.testing.assert_allclose(np.asarray(info["scale"], dtype=float), seen["scale"], rtol=1e-6)
    if seen["softcap"] is not None:
        assert info["softcap"] == seen["softcap"]
    ref = _reference(seen)
    for metric in METRICS:
        np.testing.assert_allclose(s.value("root", metric), ref[metric], rtol=2e-4, atol=1e-6, err_msg=metric)
    # the counterfactual scales come from the same recovered q, k, bias and mask
    unscaled = _reference(seen, scale=1.0)
    for metric in METRICS:
        np.testing.assert_allclose(s.value("root", metric, "unscaled"), unscaled[metric], rtol=2e-4, atol=1e-6)


def test_output_layer_softmax_is_not_attention():
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.proj = nn.Linear(8, 16)

        def forward(self, ids):
            h = self.emb(ids)
            tied = torch.matmul(h, self.emb.weight.t()).softmax(-1)  # tied output layer
            linear = F.softmax(self.proj(h), dim=-1)
            batched = h @ h.transpose(-1, -2)  # a product, but a softmax over dim 1
            return tied, linear, torch.softmax(batched, dim=1)

    model = Head()
    with probe.watch(model) as p:
        model(torch.randint(0, 16, (2, 5)))
    assert p.summary().sites == []


def test_unknown_scale_reported_from_softmax_input_with_one_warning():
    model = Eager("unknown")
    x, pad = _batch()
    with pytest.warns(UserWarning, match=r"site 'root' could not be recovered") as record:
        with probe.watch(model) as p:
            model(x, pad)
            model(x, pad)
    assert sum("could not be recovered" in str(w.message) for w in record) == 1
    s = p.summary()
    assert s.info("root")["scale"] is None and s.info("root")["calls"] == 2
    z = model.seen["logits"].detach().double()
    valid = (z > torch.finfo(torch.float32).min / 2).expand(B, H, L, L)
    # the reference sees Z as "logits at scale 1 on q = identity": build it plainly from Z
    ref = {m: np.zeros(H) for m in METRICS}
    for h in range(H):
        vals = z[:, h][valid[:, h]].numpy()
        ref["logit_var"][h], ref["logit_max"][h] = vals.var(), vals.max()
        ents, maxps = [], []
        for b in range(B):
            for i in range(L):
                row = z[b, h, i][valid[b, h, i]].numpy()
                p_ = np.exp(row - row.max())
                p_ /= p_.sum()
                ents.append(-(p_ * np.log(p_)).sum() / math.log(row.size))
                maxps.append(p_.max())
        ref["entropy"][h], ref["max_prob"][h] = np.mean(ents), np.mean(maxps)
        ref["saturation"][h] = np.mean(np.array(maxps) >= 0.99)
    for metric in METRICS:
        np.testing.assert_allclose(s.value("root", metric), ref[metric], rtol=2e-4, atol=1e-6, err_msg=metric)
    assert "unscaled" not in s.to_dict()["sites"]["root"]["metrics"]["entropy"]


@pytest.mark.parametrize("fused", [True, False])
def test_timm_style_both_paths_same_metrics_and_scale(fused):
    torch.manual_seed(0)
    model = TinyViT().eval()
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.5)
    x = torch.randn(2, 7, 32)
    results = {}
    for path in (True, False):
        model.set_fused_attn(path)
        ref_out = model(x)
        with probe.watch(model) as p:
            out = model(x)
        assert torch.equal(out, ref_out)
        results[path] = p.summary()
    a, b = results[fused], results[not fused]
    assert a.sites == b.sites == ["blocks.0.attn", "blocks.1.attn"]
    for site in a.sites:
        assert a.info(site)["scale"] == pytest.approx(model.blocks[0].attn.scale, rel=1e-7)
        assert b.info(site)["scale"] == pytest.approx(model.blocks[0].attn.scale, rel=1e-7)
        for metric in METRICS:
            for scale in ("actual", "unscaled"):
                np.testing.assert_allclose(a.value(site, metric, scale), b.value(site, metric, scale),
                                           rtol=1e-4, atol=1e-6)
    assert {a.info(s)["kind"] for s in a.sites} == {"sdpa" if fused else "eager"}


def test_no_tensor_kept_and_no_hook_left():
    model = Eager("hf")
    x, pad = _batch()
    with probe.watch(model) as p:
        model(x, pad)
        eager = next(f for f in p._frontends if isinstance(f, EagerFrontEnd))
        assert not eager._table and not eager._pending  # cleared when the capture mode exited
    assert not _get_current_function_mode_stack()
    assert not nn.modules.module._global_forward_hooks and not nn.modules.module._global_forward_pre_hooks
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_gradients_unchanged_and_q_grad_seen():
    model = Eager("hf")
    x, pad = _batch()
    model(x, pad).square().sum().backward()
    ref = [p_.grad.clone() for p_ in model.parameters() if p_.grad is not None]
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no capture warning on a supported pattern
        with probe.watch(model) as p:
            model(x, pad).square().sum().backward()
    got = [p_.grad for p_ in model.parameters() if p_.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(got, ref)) and len(got) == len(ref)
    metrics = p.summary().to_dict()["sites"]["root"]["metrics"]
    assert "grad_q" in metrics and "grad_k" in metrics


@pytest.mark.parametrize("style", ["hf", "nanogpt", "t5_inplace", "timm", "bmm", "baddbmm", "einsum", "softcap"])
def test_grad_logits_is_the_gradient_of_the_softmax_input(style):
    # Once P @ v is seen the call carries v and the output, so the backward metrics exist; at
    # `actual` grad_logits is ‖∂L/∂Z‖ per head for the Z the softmax consumed (from autograd).
    model = Eager(style)
    x, pad = _batch()
    with probe.watch(model) as p:
        out = model(x, pad)
        out.square().sum().backward()
    s = p.summary()
    ref = model.z.grad.double().reshape(B, H, L, L).square().sum((0, 2, 3)).sqrt().numpy()
    np.testing.assert_allclose(s.value("root", "grad_logits"), ref, rtol=1e-4)
    metrics = s.to_dict()["sites"]["root"]["metrics"]
    assert {"grad_q", "grad_k", "grad_v"} <= set(metrics)


@pytest.mark.parametrize("style", STYLES + ["unknown"])
def test_capture_and_reductions_never_sync(style):
    # On `meta` tensors any host read (.item(), bool(t), nonzero) raises: capture and the
    # reductions of what it captured must run there unchanged.
    from probe.capture.mode import CaptureMode
    from probe.stats.forward import forward_stats, logits_stats

    model = Eager(style).to("meta")
    x, pad = _batch()
    calls = []
    with CaptureMode([EagerFrontEnd()], calls.append):
        model(x.to("meta"), pad.to("meta"))
    (call,) = calls
    with torch.no_grad():  # as the profiler runs them
        if style == "unknown":
            assert call.scale is None and call.logits is not None
            fields = logits_stats(call.logits)
        else:
            assert call.v is not None and call.output is not None and call.output.shape == (B, H, L, D)
            fields = forward_stats(call, {"actual": call.scale, "unscaled": 1.0})
    assert fields["rows"].device.type == "meta" and fields["entropy@actual"].shape == (H,)


def test_probabilities_never_multiplied_by_v_still_reported_without_v():
    model = Eager("manual_pv")
    x, pad = _batch()
    with probe.watch(model) as p:
        model(x, pad).square().sum().backward()
    s = p.summary()
    ref = _reference(model.seen)
    for metric in METRICS:
        np.testing.assert_allclose(s.value("root", metric), ref[metric], rtol=2e-4, atol=1e-6, err_msg=metric)
    metrics = s.to_dict()["sites"]["root"]["metrics"]
    # no v: no grad_v; grad_logits comes from the hook on the softmax output itself
    assert "grad_q" in metrics and "grad_v" not in metrics and "grad_logits" in metrics
    assert np.isfinite(s.value("root", "grad_logits")).all() and (s.value("root", "grad_logits") > 0).all()


def test_bmm_without_heads_counts_each_batch_row_as_one_head():
    class Flat(nn.Module):  # (N, L, d) from the start: no (B, H) merge to recover
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(D, D) for _ in range(3))

        def forward(self, x):
            q, k = self.q(x), self.k(x)
            self.seen = (q, k)
            att = torch.bmm(q, k.transpose(1, 2)) * D ** -0.5
            return torch.bmm(att.softmax(-1), self.v(x))

    torch.manual_seed(0)
    model = Flat()
    x = torch.randn(3, L, D) * 2
    with probe.watch(model) as p:
        model(x)
    s = p.summary()
    assert s.info("root")["heads"] == 1 and s.info("root")["scale"] == pytest.approx(D ** -0.5)
    q, k = model.seen
    ref = reference_metrics(q.unsqueeze(1), k.unsqueeze(1), D ** -0.5, torch.ones(3, 1, L, L, dtype=torch.bool))
    for metric in METRICS:
        np.testing.assert_allclose(s.value("root", metric), ref[metric], rtol=2e-4, atol=1e-6, err_msg=metric)


def test_half_precision_casts_keep_q_k_v_for_gradients():
    # bf16 activations upcast before the product (q.float() @ k.T.float()): the casts are seen
    # through, so the grad hooks sit on the model's own q, k, v.
    class Upcast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(H * D, 3 * H * D)

        def forward(self, x):
            q, k, v = self.qkv(x).to(torch.bfloat16).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
            att = (q.float() * D ** -0.5) @ k.transpose(-1, -2).float()  # cast after the transpose
            att = torch.softmax(att, dim=-1).to(v.dtype)
            return (att @ v).float().transpose(1, 2).reshape(B, L, H * D)

    torch.manual_seed(0)
    model = Upcast()
    with probe.watch(model) as p:
        model(torch.randn(B, L, H * D)).square().sum().backward()
    s = p.summary()
    assert s.info("root")["scale"] == pytest.approx(D ** -0.5)
    assert {"grad_q", "grad_k", "grad_v", "grad_logits"} <= set(s.to_dict()["sites"]["root"]["metrics"])


def test_transposed_scores_are_measured_with_q_and_k_swapped():
    # softmax over scoresᵀ (keys attend to queries) has the same shape when L == S but other
    # values: it is the attention of (k, q) at the same scale (tests/capture/test_transposed_scores.py)
    class KeysAttend(nn.Module):
        def forward(self, q, k):
            self.z = (q @ k.transpose(-1, -2)).transpose(-1, -2)
            return torch.softmax(self.z, dim=-1)

    model = KeysAttend()
    with probe.watch(model) as p:
        model(torch.randn(B, H, L, D), torch.randn(B, H, L, D))
    s = p.summary()
    assert s.info("root")["scale"] == 1.0
    z = model.z.double()
    np.testing.assert_allclose(s.value("root", "logit_max"), z.amax((0, 2, 3)).numpy(), rtol=1e-6)
    np.testing.assert_allclose(s.value("root", "logit_var"), z.var((0, 2, 3), unbiased=False).numpy(), rtol=1e-5)


def test_a_record_whose_scale_is_unknown_is_measured_at_actual_only(monkeypatch):
    """``AttentionCall.scale_unknown``: the logits ``scale · q·kᵀ`` are exact, their attribution is
    not: `actual` against float64, no counterfactual scale, info scale None with the reason, one
    warning naming the site and the reason."""
    import dataclasses

    from probe.capture import registry
    from probe.capture.sdpa import SDPAFrontEnd

    class Unattributed(SDPAFrontEnd):
        def handle(self, func, args, kwargs, emit):
            inner = None if emit is None else (lambda call: emit(dataclasses.replace(call, scale_unknown="a test")))
            return super().handle(func, args, kwargs, inner)

    monkeypatch.setattr(registry, "FRONT_ENDS", (Unattributed,) + registry.FRONT_ENDS[1:])
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))

    class Attend(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, scale=0.7)

    model = Attend()
    with pytest.warns(UserWarning, match=r"site 'root' could not be recovered from its ops \(a test\)"):
        with probe.watch(model) as p:
            model(q, k, v)
    s = p.summary()
    info = s.info("root")
    assert info["scale"] is None and info["scale_unknown"] == "a test"
    ref = reference_metrics(q, k, 0.7, torch.ones(B, H, L, L, dtype=torch.bool))
    for metric in ("logit_var", "entropy", "max_prob"):
        np.testing.assert_allclose(s.value("root", metric), ref[metric], rtol=1e-5, atol=1e-7)
    with pytest.raises(probe.ProbeError):
        s.value("root", "entropy", "unscaled")


def test_the_rule_table_in_the_docs_is_current():
    """docs/architecture.md shows the eager tracer's rule table as ``probe.capture.rules.rule_table``
    renders it (regenerate with ``python -m probe.capture.eager``)."""
    from pathlib import Path

    from probe.capture.rules import rule_table

    text = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    shown = text.split("<!-- rule table: start -->\n", 1)[1].split("\n<!-- rule table: end -->", 1)[0]
    assert shown == rule_table()


def test_a_site_probe_scaling_leaves_unchanged_is_still_recorded():
    """probe.scaling cannot rewrite a soft-capped eager softmax (left unchanged, told): the probe
    below it still records the site at its own scale, and the audit misses nothing."""
    model = Eager("softcap")
    x, pad = _batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model) as p, probe.scaling(model, "unscaled"):
            model(x, pad)
    said = [str(w.message) for w in caught]
    assert any("NOT rewritten" in m for m in said) and not any("NOT measured" in m for m in said), said
    info = p.summary().info("root")
    assert info["softcap"] == pytest.approx(5.0) and info["scale"] == pytest.approx(D ** -0.5)


def test_a_factor_on_a_position_table_is_not_a_factor_on_q():
    """A 2-d tensor times a number is followed (learned queries ``(N, d)``, rows flattened to
    ``(B·T, D)``: the `flat_rows` style) only straight into a product. A position table's factor
    (x-transformers' xpos: ``base ** ((t - T/2) / 512)``, then a multiplier on q and k) is
    forgotten at the op after it: the scale stays the model's, not unknown."""
    class XPos(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(D * H, 3 * D * H)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
            t = torch.arange(L, dtype=x.dtype).view(1, L)
            power = (t - L // 2) / 512  # (1, L): a factor 1/512 on a 2-d tensor
            table = torch.linspace(0.6, 1.0, D) ** power.view(1, L, 1)  # (1, L, d)
            cos = torch.linspace(0.5, 1.0, D)  # a rotary-like multiplier first, as xpos's `t * freqs.cos() * scale`
            q, k = q * cos * table, k * cos * table.reciprocal()
            return ((q @ k.transpose(-2, -1)) * D ** -0.5).softmax(-1) @ v

    torch.manual_seed(0)
    model = XPos()
    with probe.watch(model) as p:
        model(torch.randn(B, L, D * H)).sum().backward()
    info = p.summary().info("root")
    assert info["scale"] == pytest.approx(D ** -0.5) and not info.get("scale_unknown"), info


class GridRope(nn.Module):
    """timm's DINOv3 rotary embedding (``RotaryEmbeddingDinoV3``, built each forward for the image's
    grid): coordinates ``2.0 * grid - 1.0`` on an ``(H, W, 2)`` grid (3-d, so a factor was followed),
    whose ``- 1`` made the record opaque; the sin / cos tables carried it into ``q * cos``, and the
    scale read unknown for every block of ``vit_*_dinov3``. A table broadcast over q's leading dims
    is never a function of q: its record is not q's."""

    def __init__(self, prescale: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(D * H, 3 * D * H)
        self.prescale = prescale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        if self.prescale:
            q = q * D ** -0.5
        ys, xs = torch.meshgrid(torch.arange(2.0), torch.arange(L / 2), indexing="ij")
        grid = torch.stack([(ys + 0.5) / 2, (xs + 0.5) / (L / 2)], dim=-1)  # (2, L/2, 2)
        grid = 2.0 * grid - 1.0  # [0, 1] -> [-1, 1]
        angles = (2 * math.pi * grid.flatten(0, -2)[:, :, None] / torch.tensor([1.0, 10.0])).flatten(1)  # (L, d/2)
        sin, cos = angles.sin().repeat_interleave(2, -1), angles.cos().repeat_interleave(2, -1)  # (L, d)

        def rot(t: torch.Tensor) -> torch.Tensor:
            return torch.stack([-t[..., 1::2], t[..., ::2]], -1).reshape(t.shape)

        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        if self.prescale:
            return F.scaled_dot_product_attention(q, k, v, scale=1.0)
        return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("prescale", [False, True])
def test_a_factor_lost_on_a_rotary_grid_is_not_q_s(prescale):
    torch.manual_seed(0)
    model = GridRope(prescale)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, every=1) as p:
            model(torch.randn(B, L, D * H)).sum().backward()
    info = p.summary().info("root")
    assert info["scale"] == pytest.approx(D ** -0.5) and not info.get("scale_unknown"), info
    assert not [w for w in caught if "probe" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.parametrize("where", ["q", "scores", "scores /"])
def test_numpy_scalar_factors_are_read(where):
    """``q * np.float32(s)`` (NumPy's float32 is not a Python float) was read as no factor: scale
    1.0 reported, verified (the softmax matched), the counterfactual scales off by ``s``."""
    s32 = np.float32(D ** -0.5)

    class NumpyScale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(D * H, 3 * D * H)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
            if where == "q":
                att = (q * s32) @ k.transpose(-2, -1)
            elif where == "scores":
                att = (q @ k.transpose(-2, -1)) * s32
            else:
                att = (q @ k.transpose(-2, -1)) / np.float16(D ** 0.5)
            return att.softmax(-1) @ v

    torch.manual_seed(0)
    model = NumpyScale()
    with probe.watch(model) as p:
        model(torch.randn(B, L, D * H)).sum().backward()
    info = p.summary().info("root")
    assert info["scale"] == pytest.approx(D ** -0.5, rel=1e-3) and not info.get("scale_unknown"), info
