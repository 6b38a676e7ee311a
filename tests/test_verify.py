"""Verify, don't assume (issue 25): each site's reconstruction is checked against what the model
computed; a mismatch makes the site unverified, warned, and reported only from the model's own
probabilities."""

from __future__ import annotations

import math
import warnings
from typing import List

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe
from probe.call import AttentionCall
from probe.session import verify as verify_mod
from probe.stats.verify import check_positions, output_distance, probs_distance, probs_fields, reconstruct
from tests.helpers import SDPAModel, reference_metrics, watched_once


def _messages(caught) -> List[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("probe:")]


# -- the pure checks, against plain float64 -------------------------------------------------------
def _softmax64(q, k, scale, valid, bias=None, softcap=None):
    g = q.shape[1] // k.shape[1]
    z = torch.einsum("bhld,bhsd->bhls", q.double(), k.double().repeat_interleave(g, 1)) * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if bias is not None:
        z = z + bias.double()
    z = z.masked_fill(~valid, -math.inf)
    return torch.softmax(z, -1).nan_to_num(0.0)


@pytest.mark.parametrize("case", ["plain", "gqa", "causal", "mask", "bias", "softcap", "per_head"])
def test_reconstruct_is_the_float64_softmax_of_the_record(case):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 2 if case == "gqa" else 4, 6, 8, generator=g)
    valid = torch.ones(2, 4, 6, 6, dtype=torch.bool)
    kw, scale = {}, 0.3
    if case == "causal":
        kw["causal"] = True
        valid = valid & torch.ones(6, 6, dtype=torch.bool).tril()
    if case == "mask":
        kw["mask"] = torch.rand(2, 1, 6, 6, generator=g) > 0.3
        valid = valid & kw["mask"]
    if case == "bias":
        bias = torch.randn(1, 4, 6, 6, generator=g)
        bias[..., 0] = -1e9  # masks (at or below -100)
        kw["bias"] = bias
        valid = valid & (bias > -100)
    if case == "softcap":
        kw["softcap"] = 2.0
    if case == "per_head":
        scale = torch.tensor([0.1, 0.2, 0.3, 0.4])
    call = AttentionCall(q=q, k=k, v=None, scale=scale, **kw)
    pos = check_positions(6, 4, q.device)
    p, ok, _ = reconstruct(call, 2, pos)
    s = scale.reshape(1, -1, 1, 1).double() if isinstance(scale, torch.Tensor) else scale
    ref = _softmax64(q, k, s, valid, kw.get("bias"), kw.get("softcap"))[:, :, pos]
    torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7)
    assert torch.equal(ok, valid.expand(2, 4, 6, 6)[:, :, pos])


def test_positions_spread_and_include_both_ends():
    assert check_positions(100, 8, torch.device("cpu")).tolist() == [0, 14, 28, 42, 57, 71, 85, 99]
    assert check_positions(3, 8, torch.device("cpu")).tolist() == [0, 1, 2]
    assert check_positions(5, 1, torch.device("cpu")).tolist() == [0]


def test_probs_distance_accepts_the_model_and_rejects_a_wrong_scale():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 4, 9, 8, generator=g), torch.randn(2, 4, 9, 8, generator=g)
    probs = torch.softmax(q @ k.transpose(-1, -2) * 8**-0.5, -1)
    pos = check_positions(9, 8, q.device)
    right = AttentionCall(q=q, k=k, v=None, scale=8**-0.5)
    dist, tol = probs_distance(right, probs, 2, pos)
    assert float(dist) < 1e-6 and float(tol) == pytest.approx(1e-4)
    wrong = AttentionCall(q=q, k=k, v=None, scale=1.0)
    dist, tol = probs_distance(wrong, probs, 2, pos)
    assert float(dist) > 100 * float(tol)


def test_output_distance_accepts_the_model_and_rejects_a_missed_mask():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    pos = check_positions(9, 8, q.device)
    dist, tol = output_distance(AttentionCall(q=q, k=k, v=v, scale=8**-0.5, causal=True), out, 2, pos)
    assert float(dist) < 1e-5 <= float(tol)
    dist, tol = output_distance(AttentionCall(q=q, k=k, v=v, scale=8**-0.5), out, 2, pos)
    assert float(dist) > 100 * float(tol)


def test_a_half_precision_model_is_held_to_its_own_rounding():
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 2, 16, 8, generator=g).bfloat16(), torch.randn(1, 2, 16, 8, generator=g).bfloat16()
    probs = torch.softmax(q @ k.transpose(-1, -2) * 8**-0.5, -1)  # bfloat16 all the way
    pos = check_positions(16, 8, q.device)
    dist, tol = probs_distance(AttentionCall(q=q, k=k, v=None, scale=8**-0.5), probs, 1, pos)
    assert float(dist) <= float(tol) < 0.5
    dist, tol = probs_distance(AttentionCall(q=q, k=k, v=None, scale=4 * 8**-0.5), probs, 1, pos)
    assert float(dist) > float(tol)


def test_probs_fields_match_the_float64_reference():
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 3, 7, 8, generator=g), torch.randn(2, 3, 7, 8, generator=g)
    valid = torch.ones(7, 7, dtype=torch.bool).tril().expand(2, 3, 7, 7)
    probs = torch.softmax((q @ k.transpose(-1, -2) * 0.7).masked_fill(~valid, -math.inf), -1)
    fields = probs_fields(probs, 0.9, 2**20)
    ref = reference_metrics(q, k, 0.7, valid, tau=0.9)
    rows = fields["rows"].numpy()
    for metric, field in (("entropy", "entropy@actual"), ("max_prob", "max_prob@actual"), ("saturation", "saturated@actual")):
        np.testing.assert_allclose(fields[field].numpy() / rows, ref[metric], rtol=1e-5, atol=1e-7)


# -- end to end ---------------------------------------------------------------------------------------
class ReusedBuffer(nn.Module):
    """Eager attention whose bias buffer is reused (zeroed) after the softmax: the record reads the
    buffer when the call is emitted, so probe's reconstruction no longer matches the model."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.heads = heads
        self.register_buffer("work", torch.zeros(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        self.work.copy_(torch.triu(torch.full((n, n), 3.0)))
        probs = (q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5 + self.work).softmax(-1)
        self.captured = probs.detach().clone()
        self.work.zero_()
        return (probs @ v).transpose(1, 2).reshape(b, n, d)


def test_a_reconstruction_that_does_not_match_is_unverified_and_reported_from_the_models_probabilities():
    torch.manual_seed(0)
    model, x = ReusedBuffer(), torch.randn(2, 8, 16)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    reference = model(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model) as p:
            out = model(x)
            out.sum().backward()
    assert torch.equal(out, reference)
    assert all(torch.equal(w.grad, e) for w, e in zip(model.parameters(), expected))
    messages = _messages(caught)
    unverified = [m for m in messages if "UNVERIFIED" in m]
    assert len(unverified) == 1 and "'root'" in unverified[0] and "the softmax output" in unverified[0]
    assert not any("gradient metrics NOT measured" in m for m in messages)  # said by the warning above
    s = p.summary()
    info = s.info("root")
    assert info["verified"] is False and info["scale"] is None
    assert sorted(s.metrics("root")) == ["entropy", "grad_k", "grad_q", "grad_v", "max_prob", "saturation"]
    assert s.scales("root", "entropy") == ["actual"]
    # the values are those of the model's own probabilities (a float64 reference from them)
    probs = model.captured.double()
    entropy = -(probs * probs.clamp_min(1e-300).log()).sum(-1) / math.log(8)
    np.testing.assert_allclose(s.value("root", "entropy"), entropy.mean((0, 2)).numpy(), rtol=1e-5)
    np.testing.assert_allclose(s.value("root", "max_prob"), probs.amax(-1).mean((0, 2)).numpy(), rtol=1e-5)
    missing = s.not_measured("root")
    values = [v for vs in missing.values() for v in vs]
    assert {"logit_var@actual", "logit_max@unscaled", "nonfinite", "entropy@standard", "grad_logits@actual"} <= set(values)
    assert all("unverified" in why for why in missing)


def test_a_front_end_that_misreads_sdpa_is_caught(monkeypatch):
    """A front-end bug (here: the scale doubled) makes the SDPA site unverified: no forward
    metric, no grad_logits; grad_q, grad_k, grad_v (the model's own gradients) stay."""
    import probe.capture.sdpa as sdpa

    real = sdpa.sdpa_call

    def misread(*args, **kwargs):
        import dataclasses

        call = real(*args, **kwargs)
        return None if call is None else dataclasses.replace(call, scale=2 * call.scale)

    monkeypatch.setattr(sdpa, "sdpa_call", misread)
    model, x = SDPAModel(layers=2, d_model=32, heads=4), torch.randn(2, 6, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model) as p:
            model(x).sum().backward()
    assert sum("UNVERIFIED" in m for m in _messages(caught)) == 2
    s = p.summary()
    for site in ("layers.0", "layers.1"):
        assert s.info(site)["verified"] is False
        assert s.info(site)["verification"].startswith("its output, against P·v")
        assert sorted(s.metrics(site)) == ["grad_k", "grad_q", "grad_v"]
    report = probe.coverage(model, x)
    assert [r.verified for r in report.rows] == [False, False] and len(report.unverified) == 2
    assert "NO" in str(report) and "0 verified" in str(report)


@pytest.mark.parametrize("kind", ["sdpa", "sdpa_dropout", "mha", "mha_weights_dropout", "eager"])
def test_every_front_end_is_verified_on_a_correct_record(kind):
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    if kind.startswith("sdpa"):
        model = SDPAModel(layers=1, d_model=16, heads=2, causal=True)
        if kind == "sdpa_dropout":
            model.layers[0].forward = _with_dropout(model.layers[0])
        model.train()
    elif kind.startswith("mha"):
        mha = nn.MultiheadAttention(16, 2, batch_first=True, dropout=0.3 if "dropout" in kind else 0.0)
        model = _MHA(mha, need_weights="weights" in kind).train()
    else:
        model = ReusedBuffer()
        model.work.fill_(0.0)
        model.forward = lambda x, m=model: _plain_eager(m, x)
    with probe.watch(model) as p:
        model(x).sum().backward()
    s = p.summary()
    info = s.info(s.sites[0])
    assert info["verified"] is True, info
    if "dropout" in kind:
        assert info["verification"].startswith("its own function without dropout")
    assert float(info["verification"].split("distance ")[1].split(" ")[0]) < 1e-5


class _MHA(nn.Module):
    def __init__(self, mha: nn.MultiheadAttention, need_weights: bool) -> None:
        super().__init__()
        self.mha, self.need_weights = mha, need_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x, need_weights=self.need_weights)[0]


def _with_dropout(layer):
    def forward(x, mask=None):
        b, n, _ = x.shape
        q = layer.q(x).view(b, n, layer.heads, layer.d).transpose(1, 2)
        k, v = layer.kv(x).view(b, n, 2, layer.kv_heads, layer.d).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True)
        return layer.o(y.transpose(1, 2).reshape(b, n, -1))
    return forward


def _plain_eager(model: ReusedBuffer, x: torch.Tensor) -> torch.Tensor:
    b, n, d = x.shape
    q, k, v = model.qkv(x).view(b, n, 3, model.heads, d // model.heads).permute(2, 0, 3, 1, 4)
    probs = (q @ k.transpose(-2, -1) * (d // model.heads) ** -0.5).softmax(-1)
    return (F.dropout(probs, 0.5, training=True) @ v).transpose(1, 2).reshape(b, n, d)


def test_probabilities_changed_in_place_after_the_softmax_are_unchecked_not_unverified():
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(2, 6, 3, 2, 8).permute(2, 0, 3, 1, 4)
            probs = (q @ k.transpose(-2, -1) * 8**-0.5).softmax(-1)
            probs = F.dropout(probs, 0.5, training=True, inplace=True)
            return (probs @ v).transpose(1, 2).reshape(2, 6, 16)

    model = InPlace()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model) as p:
            model(torch.randn(2, 6, 16))
    assert not any("UNVERIFIED" in m for m in _messages(caught))
    info = p.summary().info("root")
    assert info["verified"] is None and "changed in place after the softmax" in info["verification"]


def test_a_later_check_catches_a_reconstruction_that_stops_matching(monkeypatch):
    monkeypatch.setattr(verify_mod, "CHECK_EVERY", 3)
    model, x = ReusedBuffer(), torch.randn(2, 8, 16)
    reuse = model.forward

    def forward(x, step=[0]):
        step[0] += 1
        if step[0] <= 4:  # the first steps: a buffer nobody zeroes after use
            b, n, d = x.shape
            q, k, v = model.qkv(x).view(b, n, 3, model.heads, d // model.heads).permute(2, 0, 3, 1, 4)
            probs = (q @ k.transpose(-2, -1) * 0.35 + torch.triu(torch.full((n, n), 3.0))).softmax(-1)
            return (probs @ v).transpose(1, 2).reshape(b, n, d)
        return reuse(x)

    model.forward = forward
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model) as p:
            for _ in range(8):
                model(x)
    unverified = [m for m in _messages(caught) if "UNVERIFIED" in m]
    assert len(unverified) == 1 and "from step 6 on (earlier steps were checked)" in unverified[0]
    info = p.summary().info("root")
    assert info["verified"] is False and "(step 6)" in info["verification"]


def test_the_check_reads_a_few_rows_within_the_budget():
    """The check's buffers are a few float64 (b, H, r, S) rows: a long call is checked on fewer
    rows and batch entries (at least one of each), a short one on every entry."""
    from probe.stats.verify import check_shape

    long = torch.empty(8, 16, 4096, 64, device="meta")
    entries, rows = check_shape(AttentionCall(q=long, k=long, v=long, scale=0.125), 8, 16 * 2**20)
    assert (entries, rows) == (1, 1)
    entries, rows = check_shape(AttentionCall(q=long, k=long, v=long, scale=0.125), 8, 2**30)
    assert rows * entries * 16 * 4096 * 32 <= 2**30 and rows == 8
    short = torch.empty(4, 4, 64, 16, device="meta")
    assert check_shape(AttentionCall(q=short, k=short, v=short, scale=0.25), 8, 16 * 2**20) == (4, 8)


def test_a_minus_100_mask_added_to_a_positive_bias_is_not_silently_counted_as_valid():
    """Shifted-window attention as timm's fused Swin runs it: SDPA with ``attn_mask = rel_bias +
    mask``, a -100 mask. The output matches, but keys the model masks sum to just above -100 where
    the bias is positive: counted as valid, they would change the normalized entropy. The check
    names it (the site is unverified) instead of reporting it silently."""

    class Shifted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(16, 48)
            self.rel = nn.Parameter(torch.full((2, 8, 8), 0.5))  # a positive relative position bias

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
            mask = x.new_zeros(8, 8)
            mask[:4, 4:] = -100.0
            mask[4:, :4] = -100.0
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.rel + mask).transpose(1, 2).reshape(2, 8, 16)

    model = Shifted()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model) as p:
            model(torch.randn(2, 8, 16))
    (message,) = [m for m in _messages(caught) if "UNVERIFIED" in m]
    assert "masked in effect" in message
    s = p.summary()
    assert s.info("root")["verified"] is False and "masked in effect" in s.info("root")["verification"]
    assert "entropy" not in s.metrics("root")  # SDPA: no probabilities of the model's own to report


def test_a_record_whose_statistics_fail_is_named_and_listed_not_lost(monkeypatch):
    import probe.session.recorder as recorder

    real = recorder.forward_rows

    def fails_at_layer_1(call, *args, **kwargs):
        if call.site == "layers.1":
            raise RuntimeError("a record the statistics cannot read")
        return real(call, *args, **kwargs)

    monkeypatch.setattr(recorder, "forward_rows", fails_at_layer_1)
    model, x = SDPAModel(layers=2, d_model=16, heads=2), torch.randn(2, 5, 16)
    p, _, said = watched_once(model, x)
    (message,) = [m for m in said if "NOT measured" in m]
    assert "'layers.1'" in message and "a record the statistics cannot read" in message
    assert p.summary().sites == ["layers.0"]
    report = probe.coverage(model, x)
    (missed,) = report.missed
    assert missed.site == "layers.1" and "its statistics failed" in missed.why
