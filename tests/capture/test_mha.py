"""nn.MultiheadAttention in all of its paths and inside nn.Transformer*: capture, metrics, parity.

Every reference here is rebuilt independently from the module's weights (projections, extra
keys, masks) and scored by the plain float64 reference in tests/helpers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe
from probe.capture.mha import mha_forward
from tests.helpers import reference_metrics

E, H, L, S, B = 16, 4, 5, 6, 2
METRICS = ("logit_var", "logit_max", "entropy", "max_prob", "saturation")


class Holder(nn.Module):
    """A root whose child ``attn`` is the MHA, so its site is ``"attn"``."""

    def __init__(self, mha: nn.Module) -> None:
        super().__init__()
        self.attn = mha

    def forward(self, *args, **kwargs):
        return self.attn(*args, **kwargs)


def _assert_clean(model: nn.Module) -> None:
    from torch.overrides import _get_current_function_mode_stack

    for name, m in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            assert not getattr(m, attr), (name, attr)
    assert not nn.modules.module._global_forward_hooks
    assert not nn.modules.module._global_forward_pre_hooks
    assert not _get_current_function_mode_stack()


# -- an independent reference: projections, extra keys and masks rebuilt from the weights ------
def _projections(mha: nn.MultiheadAttention, query, key, value):
    """q (B, H, L, d), k (B, H, S', d) in float64 with bias_k / zero key appended."""
    if not mha.batch_first and query.dim() == 3:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    if query.dim() == 2:
        query, key, value = query[None], key[None], value[None]
    e = mha.embed_dim
    if mha._qkv_same_embed_dim:
        wq, wk = mha.in_proj_weight[:e], mha.in_proj_weight[e:2 * e]
    else:
        wq, wk = mha.q_proj_weight, mha.k_proj_weight
    bq = bk = None
    if mha.in_proj_bias is not None:
        bq, bk = mha.in_proj_bias[:e], mha.in_proj_bias[e:2 * e]
    q = query.double() @ wq.double().T + (0 if bq is None else bq.double())
    k = key.double() @ wk.double().T + (0 if bk is None else bk.double())
    b = q.shape[0]
    if mha.bias_k is not None:
        k = torch.cat([k, mha.bias_k.double().reshape(1, 1, e).expand(b, 1, e)], dim=1)
    d = e // mha.num_heads
    q = q.reshape(b, -1, mha.num_heads, d).transpose(1, 2)
    k = k.reshape(b, -1, mha.num_heads, d).transpose(1, 2)
    if mha.add_zero_attn:
        k = torch.cat([k, torch.zeros(b, mha.num_heads, 1, d, dtype=k.dtype)], dim=2)
    return q, k


def _valid_and_bias(b, h, l, s_all, s, attn_mask=None, key_padding_mask=None, causal=False):
    """Full (B, H, L, S') valid mask and float bias; extra keys (indices >= s) are always valid."""
    valid = torch.ones(b, h, l, s_all, dtype=torch.bool)
    bias = torch.zeros(b, h, l, s_all, dtype=torch.float64)
    if causal:
        valid[..., :s] &= torch.ones(l, s, dtype=torch.bool).tril()
    if attn_mask is not None:
        m = attn_mask if attn_mask.dim() == 3 else attn_mask.expand(b * h, l, s)
        m = m.reshape(b, h, l, s)
        if m.dtype == torch.bool:
            valid[..., :s] &= ~m
        else:
            valid[..., :s] &= torch.isfinite(m)
            bias[..., :s] += torch.where(torch.isfinite(m), m.double(), 0.0)
    if key_padding_mask is not None:
        kpm = key_padding_mask.reshape(b, 1, 1, s)
        if kpm.dtype == torch.bool:
            valid[..., :s] &= ~kpm
        else:
            valid[..., :s] &= torch.isfinite(kpm)
            bias[..., :s] += torch.where(torch.isfinite(kpm), kpm.double(), 0.0)
    return valid, bias


def _weights_metrics(w: torch.Tensor, valid: torch.Tensor):
    """entropy and max_prob per head from the probabilities MHA returned, float64, plain loops."""
    w = w.detach().double().numpy()
    valid = valid.numpy()
    ent, mp = [], []
    for h in range(w.shape[1]):
        e_h, m_h = [], []
        for b in range(w.shape[0]):
            for i in range(w.shape[2]):
                keys = np.nonzero(valid[b, h, i])[0]
                if keys.size < 2:
                    continue
                p = w[b, h, i, keys]
                nz = p[p > 0]
                e_h.append(-(nz * np.log(nz)).sum() / math.log(keys.size))
                m_h.append(p.max())
        ent.append(np.mean(e_h))
        mp.append(np.mean(m_h))
    return np.array(ent), np.array(mp)


def _check_metrics(summary, site, q, k, valid, bias, scale):
    d = q.shape[-1]
    for name, sigma in (("actual", scale), ("unscaled", 1.0), ("standard", d ** -0.5)):
        ref = reference_metrics(q, k, sigma, valid, bias)
        for metric in METRICS:
            np.testing.assert_allclose(summary.value(site, metric, name), ref[metric], rtol=2e-4, atol=2e-5,
                                       err_msg=f"{metric}@{name}")
    assert summary.value(site, "nonfinite").sum() == 0


# -- every MHA path -----------------------------------------------------------------------------
CASES = {
    "plain": dict(),
    "seq_first": dict(batch_first=False),
    "separate_kdim_vdim": dict(kdim=12, vdim=10, cross=True),
    "cross_packed": dict(cross=True),
    "bias_kv": dict(add_bias_kv=True),
    "zero_attn": dict(add_zero_attn=True),
    "bias_kv_zero_attn_padding": dict(add_bias_kv=True, add_zero_attn=True, kpm="bool"),
    "kpm_bool": dict(kpm="bool"),
    "kpm_float": dict(kpm="float"),
    "mask2d_bool": dict(mask="2d_bool"),
    "mask2d_float": dict(mask="2d_float"),
    "mask3d_bool": dict(mask="3d_bool"),
    "mask3d_float_kpm_float": dict(mask="3d_float", kpm="float"),
    "causal": dict(causal=True),
    "causal_kpm": dict(causal=True, kpm="float"),
    "no_bias_eval": dict(bias=False, train=False),
    "eval": dict(train=False),
    "unbatched": dict(unbatched=True, kpm="bool"),
}


def _build(case: dict, need_weights: bool):
    torch.manual_seed(1)
    cross = case.get("cross", False)
    kdim, vdim = case.get("kdim"), case.get("vdim")
    mha = nn.MultiheadAttention(
        # no dropout where the returned probabilities are compared (they are dropped out)
        E, H, dropout=0.0 if need_weights else 0.1, bias=case.get("bias", True), add_bias_kv=case.get("add_bias_kv", False),
        add_zero_attn=case.get("add_zero_attn", False), kdim=kdim, vdim=vdim,
        batch_first=case.get("batch_first", True),
    )
    mha.train(case.get("train", True))
    s = S if cross else L
    if case.get("unbatched"):
        query = torch.randn(L, E)
        key = value = query
        b = 1
    else:
        query = torch.randn(B, L, E)
        key = torch.randn(B, s, kdim or E) if cross else query
        value = torch.randn(B, s, vdim or E) if cross else query
        if not mha.batch_first:
            query, key, value = (t.transpose(0, 1).contiguous() for t in (query, key, value))
            if not cross:
                key = value = query
        b = B
    kwargs = {"need_weights": need_weights}
    if need_weights:
        kwargs["average_attn_weights"] = False
    kpm = None
    if case.get("kpm"):
        kpm = torch.zeros(b, s, dtype=torch.bool)
        kpm[-1, s - 2:] = True
        if case["kpm"] == "float":
            kpm = torch.where(kpm, -math.inf, 0.0)
        kwargs["key_padding_mask"] = kpm[0] if case.get("unbatched") else kpm
    mask = None
    kind = case.get("mask")
    if case.get("causal"):
        mask = nn.Transformer.generate_square_subsequent_mask(L)
        kwargs["attn_mask"], kwargs["is_causal"] = mask, True
    elif kind:
        shape = (L, s) if kind.startswith("2d") else (b * H, L, s)
        bad = torch.rand(shape) < 0.3
        bad[..., 0] = False  # every row keeps a key
        mask = bad if kind.endswith("bool") else torch.where(bad, -math.inf, torch.randn(shape))
        kwargs["attn_mask"] = mask
    return mha, (query, key, value), kwargs, (b, s, mask, kpm)


@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "sdpa"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_mha_path_matches_reference_and_keeps_outputs(name, need_weights):
    case = CASES[name]
    mha, inputs, kwargs, (b, s, mask, kpm) = _build(case, need_weights)
    model = Holder(mha)
    torch.manual_seed(7)  # the same dropout draw with and without probe
    ref_out, ref_w = model(*inputs, **kwargs)  # grad enabled: PyTorch's unfused path, as under probe
    torch.manual_seed(7)
    with probe.watch(model) as p:
        out, w = model(*inputs, **kwargs)
    assert torch.equal(out, ref_out)
    if need_weights:
        assert torch.equal(w, ref_w)
    s_ = p.summary()
    assert s_.sites == ["attn"]
    info = s_.info("attn")
    assert info["kind"] == "mha" and info["heads"] == H and info["d_k"] == E // H and info["calls"] == 1
    assert info["scale"] == pytest.approx(1 / math.sqrt(E // H), rel=1e-12)

    q, k = _projections(mha, *inputs)
    s_all = k.shape[2]
    causal = case.get("causal", False)
    valid, bias = _valid_and_bias(b, H, L, s_all, s, None if causal else mask, kpm, causal=causal)
    _check_metrics(s_, "attn", q, k, valid, bias, 1 / math.sqrt(E // H))

    if need_weights:  # the probabilities MHA itself returned agree with probe's softmax metrics
        w4 = w.reshape(b, H, L, s_all)
        ent, mp = _weights_metrics(w4, valid)
        np.testing.assert_allclose(s_.value("attn", "entropy"), ent, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(s_.value("attn", "max_prob"), mp, rtol=1e-4, atol=1e-5)
    _assert_clean(model)


def test_mirror_is_bitwise_pytorch_with_static_kv_and_averaged_weights():
    torch.manual_seed(2)
    mha = nn.MultiheadAttention(E, H)
    x = torch.randn(L, B, E)
    static_k, static_v = torch.randn(B * H, S, E // H), torch.randn(B * H, S, E // H)
    args = (x, x, x, E, H, mha.in_proj_weight, mha.in_proj_bias, None, None, False, 0.0,
            mha.out_proj.weight, mha.out_proj.bias)
    for kw in (dict(static_k=static_k, static_v=static_v), dict(average_attn_weights=True), dict(need_weights=False)):
        ref = F.multi_head_attention_forward(*args, **kw)
        got = mha_forward(*args, **kw)
        assert torch.equal(ref[0], got[0])
        assert (ref[1] is None and got[1] is None) or torch.equal(ref[1], got[1])


def test_bad_arguments_raise_pytorchs_own_errors():
    mha = Holder(nn.MultiheadAttention(E, H, batch_first=True))
    x = torch.randn(B, L, E)
    with pytest.raises(RuntimeError) as ref:
        mha(x, x, x, attn_mask=torch.zeros(L + 1, L))
    with probe.watch(mha), pytest.raises(RuntimeError) as got:
        mha(x, x, x, attn_mask=torch.zeros(L + 1, L))
    assert str(got.value) == str(ref.value)
    _assert_clean(mha)


# -- nn.Transformer*: site names, fast paths, parity ----------------------------------------------
def _layer_inputs(model: nn.Module, run):
    """The (query, key) each MultiheadAttention of ``model`` receives, from PyTorch's unfused path."""
    seen = {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, nn.MultiheadAttention):
            def pre(mod, args, kwargs, name=name):
                seen[name] = (mod, args[0].detach().clone(), args[1].detach().clone(), kwargs)
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        torch.backends.mha.set_fastpath_enabled(False)
        with torch.no_grad():
            run()
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
        for h in handles:
            h.remove()
    return seen


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("wrapped", [False, True], ids=["root", "child"])
def test_transformer_encoder_eval_fast_path_runs_bitwise_and_metrics_match(wrapped):
    """In eval without grad the encoder makes a nested tensor of its padded batch (zeros at padded
    positions): under probe too, bitwise; the padded query rows are never computed, so not measured."""
    torch.manual_seed(3)
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    model = Holder(encoder) if wrapped else encoder
    prefix = "attn." if wrapped else ""
    x = torch.randn(B, L, E)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, 3:] = True
    with torch.no_grad():
        ref = model(x, src_key_padding_mask=kpm)  # PyTorch's nested-tensor fast path
        with probe.watch(model) as p:
            out = model(x, src_key_padding_mask=kpm)
    assert torch.equal(out, ref)
    assert torch.equal(ref[kpm], torch.zeros_like(ref[kpm]))  # the fast path's padding
    s_ = p.summary()
    assert s_.sites == [f"{prefix}layers.0.self_attn", f"{prefix}layers.1.self_attn"]
    inputs = _layer_inputs(encoder, lambda: encoder(x, src_key_padding_mask=kpm))
    for site in s_.sites:
        mha, query, key, _ = inputs[site[len(prefix):]]
        q, k = _projections(mha, query, key, key)
        valid, bias = _valid_and_bias(B, H, L, L, L, key_padding_mask=kpm)
        valid &= ~kpm[:, None, :, None]  # padded query rows: not computed by the nested path
        _check_metrics(s_, site, q, k, valid, bias, 1 / math.sqrt(E // H))
    _assert_clean(model)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_transformer_eval_decoder_reading_a_padded_memory_is_bitwise():
    """nn.Transformer in eval with src_key_padding_mask but no memory_key_padding_mask: the decoder
    attends to the encoder's padded positions, which the fast path sets to zeros (then norm). Under
    probe the encoder used to run unfused, which changed the decoder's outputs at valid positions."""
    torch.manual_seed(12)
    model = nn.Transformer(E, H, 1, 1, dim_feedforward=32, dropout=0.0, batch_first=True).eval()
    src, tgt = torch.randn(B, L, E), torch.randn(B, S, E)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, 3:] = True
    with torch.no_grad():
        ref = model(src, tgt, src_key_padding_mask=kpm)
        with probe.watch(model) as p:
            out = model(src, tgt, src_key_padding_mask=kpm)
    assert torch.equal(out, ref)
    assert sorted(p.summary().sites) == [
        "decoder.layers.0.multihead_attn", "decoder.layers.0.self_attn", "encoder.layers.0.self_attn"]
    _assert_clean(model)


@pytest.mark.parametrize("case", ["plain", "kpm", "fully_masked_row", "need_weights"])
def test_mha_eval_fast_path_runs_bitwise_and_metrics_match(case):
    """torch._native_multi_head_attention runs under probe as without it (a fully masked row: the
    fused kernel's number, not the unfused path's NaN); the attention is measured beside it."""
    torch.manual_seed(13)
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    model = Holder(mha)
    x = torch.randn(B, L, E)
    kwargs = dict(need_weights=case == "need_weights")
    kpm = mask = None
    if case == "kpm":
        kpm = kwargs["key_padding_mask"] = torch.zeros(B, L, dtype=torch.bool)
        kpm[1, 3:] = True
    if case == "fully_masked_row":
        mask = kwargs["attn_mask"] = torch.zeros(L, L, dtype=torch.bool)
        mask[1] = True
    with torch.no_grad():
        ref = model(x, x, x, **kwargs)
        with probe.watch(model) as p:
            out = model(x, x, x, **kwargs)
    assert torch.equal(out[0].nan_to_num(123.0), ref[0].nan_to_num(123.0))
    s_ = p.summary()
    assert s_.sites == ["attn"]
    q, k = _projections(mha, x, x, x)
    valid, bias = _valid_and_bias(B, H, L, L, L, attn_mask=mask, key_padding_mask=kpm)
    _check_metrics(s_, "attn", q, k, valid, bias, 1 / math.sqrt(E // H))
    _assert_clean(model)


@pytest.mark.parametrize("kind", ["encoder", "decoder", "transformer"])
def test_transformer_training_bitwise_outputs_grads_and_sites(kind):
    torch.manual_seed(4)
    kw = dict(dim_feedforward=32, dropout=0.1, batch_first=True)
    src, tgt = torch.randn(B, L, E), torch.randn(B, S, E)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(S)
    if kind == "encoder":
        model = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, **kw), 2, enable_nested_tensor=False)
        run = lambda: model(src, is_causal=False)  # noqa: E731
        sites = ["layers.0.self_attn", "layers.1.self_attn"]
    elif kind == "decoder":
        model = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, **kw), 1)
        run = lambda: model(tgt, src, tgt_mask=tgt_mask, tgt_is_causal=True)  # noqa: E731
        sites = ["layers.0.multihead_attn", "layers.0.self_attn"]
    else:
        model = nn.Transformer(E, H, num_encoder_layers=1, num_decoder_layers=1, **kw)
        run = lambda: model(src, tgt, tgt_mask=tgt_mask)  # noqa: E731
        sites = ["decoder.layers.0.multihead_attn", "decoder.layers.0.self_attn", "encoder.layers.0.self_attn"]

    def outputs_and_grads(probed):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(9)
        p = probe.watch(model) if probed else None
        out = run()
        out.square().mean().backward()
        summary = p.summary() if p else None
        if p:
            p.close()
        return out.detach(), [t.grad.clone() for t in model.parameters()], summary

    ref, ref_grads, _ = outputs_and_grads(False)
    out, grads, s_ = outputs_and_grads(True)
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert sorted(s_.sites) == sites
    assert all(s_.info(site)["kind"] == "mha" for site in sites)
    _assert_clean(model)


def test_decoder_self_attention_causal_metrics_match_reference():
    torch.manual_seed(5)
    model = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, 32, dropout=0.0, batch_first=True), 1).eval()
    tgt, memory = torch.randn(B, S, E), torch.randn(B, L, E)
    mask = nn.Transformer.generate_square_subsequent_mask(S)
    with probe.watch(model) as p:
        model(tgt, memory, tgt_mask=mask, tgt_is_causal=True)
    s_ = p.summary()
    inputs = _layer_inputs(model, lambda: model(tgt, memory, tgt_mask=mask, tgt_is_causal=True))
    mha, query, key, _ = inputs["layers.0.self_attn"]
    q, k = _projections(mha, query, key, key)
    valid, bias = _valid_and_bias(B, H, S, S, S, causal=True)
    _check_metrics(s_, "layers.0.self_attn", q, k, valid, bias, 1 / math.sqrt(E // H))
    mha, query, key, _ = inputs["layers.0.multihead_attn"]
    q, k = _projections(mha, query, key, key)
    valid, bias = _valid_and_bias(B, H, S, L, L)
    _check_metrics(s_, "layers.0.multihead_attn", q, k, valid, bias, 1 / math.sqrt(E // H))


def test_fused_kernel_called_directly_warns_and_runs_unchanged():
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()

    class Direct(nn.Module):
        def forward(self, x):
            return torch._native_multi_head_attention(
                x, x, x, E, H, mha.in_proj_weight, mha.in_proj_bias, mha.out_proj.weight, mha.out_proj.bias,
                None, False, True, None,
            )[0]

    model = Direct()
    x = torch.randn(B, L, E)
    with torch.no_grad():
        ref = model(x)
        with pytest.warns(UserWarning, match=r"_native_multi_head_attention.*at site 'root'.*NOT measured"):
            with probe.watch(model):
                out = model(x)
    assert torch.equal(out, ref)


# -- nested-tensor input: only PyTorch's fused path accepts it --------------------------------------
def _nested_batch():
    return torch.nested.nested_tensor([torch.randn(L, E), torch.randn(L - 2, E)])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("kind", ["mha", "layer", "layer_norm_first", "encoder"])
def test_nested_input_runs_fused_path_bitwise_and_is_measured(kind):
    torch.manual_seed(6)
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True, norm_first=kind == "layer_norm_first")
    if kind == "mha":
        inner = nn.MultiheadAttention(E, H, batch_first=True)
        model = Holder(inner)
        run = lambda x: model(x, x, x, need_weights=False)[0]  # noqa: E731
        sites = ["attn"]
    elif kind == "encoder":
        model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        run = model
        sites = ["layers.0.self_attn", "layers.1.self_attn"]
    else:
        model = nn.Sequential(layer)
        run = model
        sites = ["0.self_attn"]
    model.eval()
    x = _nested_batch()
    attn_inputs = {}
    hooked = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.TransformerEncoderLayer, nn.MultiheadAttention))]
    def record(name):
        def hook(module, args):
            attn_inputs.setdefault(name, args[0])  # returns None: the args are unchanged
        return hook

    handles = [m.register_forward_pre_hook(record(n)) for n, m in hooked]
    with torch.no_grad():
        run(x)
    for h in handles:
        h.remove()
    with torch.no_grad():
        ref = run(x)  # PyTorch's fused path, without the recording hooks (they block the layer's)
    with torch.no_grad(), probe.watch(model) as p:
        out = run(x)
    assert torch.equal(out.to_padded_tensor(0.0), ref.to_padded_tensor(0.0))
    s_ = p.summary()
    assert s_.sites == sites
    lengths = [L, L - 2]
    inside = torch.arange(L) < torch.tensor(lengths).view(-1, 1)
    valid = (inside[:, None, :, None] & inside[:, None, None, :]).expand(B, H, L, L)
    for site in sites:
        owner = site[: -len(".self_attn")] if site.endswith(".self_attn") else site
        mod = dict(model.named_modules())[owner]
        mha = mod.self_attn if isinstance(mod, nn.TransformerEncoderLayer) else mod
        xin = attn_inputs[owner].to_padded_tensor(0.0)
        if isinstance(mod, nn.TransformerEncoderLayer) and mod.norm_first:
            xin = mod.norm1(xin)
        q, k = _projections(mha, xin, xin, xin)
        _check_metrics(s_, site, q, k, valid, None, 1 / math.sqrt(E // H))
    _assert_clean(model)


# -- gradients: hooks on the exact q, k, v and attention output of the MHA graph -----------------------
@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "sdpa"])
def test_grad_metrics_match_float64_autograd_reference(need_weights):
    torch.manual_seed(8)
    mha = nn.MultiheadAttention(E, H, dropout=0.0, batch_first=True, add_bias_kv=True)
    model = Holder(mha)
    x = torch.randn(B, L, E)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, -2:] = True
    with probe.watch(model) as p:
        out = model(x, x, x, key_padding_mask=kpm, need_weights=need_weights)[0]
        out.square().mean().backward()
    s_ = p.summary()

    # float64 reference: the same attention written out, q, k, v and Z as leaves of the loss
    d = E // H
    q, k = _projections(mha, x, x, x)
    v = x.double() @ mha.in_proj_weight[2 * E:].double().T + mha.in_proj_bias[2 * E:].double()
    v = torch.cat([v, mha.bias_v.double().reshape(1, 1, E).expand(B, 1, E)], dim=1)
    v = v.reshape(B, -1, H, d).transpose(1, 2)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    valid, _ = _valid_and_bias(B, H, L, L + 1, L, key_padding_mask=kpm)
    z = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    z.retain_grad()
    att = torch.softmax(z.masked_fill(~valid, -math.inf), dim=-1) @ v
    y = att.transpose(1, 2).reshape(B, L, E) @ mha.out_proj.weight.double().T + mha.out_proj.bias.double()
    y.square().mean().backward()
    for metric, grad in (("grad_q", q.grad), ("grad_k", k.grad), ("grad_v", v.grad), ("grad_logits", z.grad)):
        ref = grad.square().sum((0, 2, 3)).sqrt().numpy()
        np.testing.assert_allclose(s_.value("attn", metric), ref, rtol=1e-3, atol=1e-9, err_msg=metric)
    _assert_clean(model)


def test_capture_and_reductions_run_on_meta_tensors():
    """No host sync: the MHA mirror and the statistics of its call run on shape-only tensors."""
    from probe.capture.mha import MHAFrontEnd
    from probe.capture.mode import CaptureMode
    from probe.stats.forward import forward_stats

    mha = nn.MultiheadAttention(E, H, batch_first=True, add_bias_kv=True, device="meta")
    x = torch.randn(B, L, E, device="meta")
    kpm = torch.zeros(B, L, dtype=torch.bool, device="meta")
    calls = []
    for need_weights in (True, False):
        with CaptureMode([MHAFrontEnd()], calls.append):
            out, _ = mha(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
        assert out.device.type == "meta"
    assert [c.kind for c in calls] == ["mha", "mha"]
    for call in calls:
        fields = forward_stats(call, {"actual": call.scale, "unscaled": 1.0}, 0.99)
        assert fields["entropy@actual"].device.type == "meta" and fields["entropy@actual"].shape == (H,)


def test_functional_call_from_a_custom_module_is_named_after_it_and_unknown_arguments_warn():
    mha = nn.MultiheadAttention(E, H)

    class Custom(nn.Module):
        def __init__(self, **extra):
            super().__init__()
            self.extra = extra

        def forward(self, x):
            return F.multi_head_attention_forward(
                x, x, x, E, H, mha.in_proj_weight, mha.in_proj_bias, None, None, False, 0.0,
                mha.out_proj.weight, mha.out_proj.bias, need_weights=False, **self.extra)[0]

    model = nn.Sequential(Custom())
    x = torch.randn(L, B, E)
    with probe.watch(model) as p:
        out = model(x)
    assert p.summary().sites == ["0"] and p.summary().info("0")["kind"] == "mha"
    assert torch.equal(out, model(x))

    def newer(*args, future_flag=None, **kwargs):  # a PyTorch whose function grew an argument
        return F.multi_head_attention_forward(*args, **kwargs)

    from probe.capture.mha import MHAFrontEnd

    got = []
    with pytest.warns(UserWarning, match=r"future_flag.*NOT measured"):
        MHAFrontEnd().handle(newer, (x, x, x, E, H, mha.in_proj_weight, mha.in_proj_bias, None, None, False, 0.0,
                                     mha.out_proj.weight, mha.out_proj.bias), {"future_flag": 1}, got.append)
    assert got == []
