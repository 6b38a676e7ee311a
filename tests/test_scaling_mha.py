"""probe.scaling on nn.MultiheadAttention (F.multi_head_attention_forward): outputs equal a float64
MHA at the overridden scale on both need_weights paths, a probe reports it and changes nothing,
restored on exit, per-site selection, applied once (the inner SDPA call is not rewritten again)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import probe
from tests.helpers import hook_count, module_state
from probe.capture.mode import is_mode_active

E, H = 32, 4  # d_k = 8
SITES = ("layers.0.self_attn", "layers.1.self_attn")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(E, H, batch_first=True)


class Stack(nn.Module):
    """Two residual nn.MultiheadAttention layers; the second gets a key padding mask."""

    def __init__(self, need_weights: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.need_weights = need_weights

    def forward(self, x, pad):
        for i, layer in enumerate(self.layers):
            x = x + layer.self_attn(x, x, x, key_padding_mask=pad if i else None,
                                    need_weights=self.need_weights)[0]
        return x


def _reference(model: Stack, x, pad, scales):
    """The same model in float64, plainly: softmax(s_h q kᵀ + mask) v per head, per layer."""
    x = x.double()
    b, n, _ = x.shape
    for i, layer in enumerate(model.layers):
        mha = layer.self_attn
        w, bias = mha.in_proj_weight.double(), mha.in_proj_bias.double()
        q, k, v = (x @ w.T + bias).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, H, E // H).transpose(1, 2) for t in (q, k, v))
        s = scales[SITES[i]]
        s = torch.as_tensor(s, dtype=torch.float64).reshape(-1, 1, 1) * torch.ones(H, 1, 1, dtype=torch.float64)
        logits = s * (q @ k.transpose(-1, -2))
        if i:
            logits = logits.masked_fill(pad[:, None, None, :], float("-inf"))
        y = (torch.softmax(logits, dim=-1) @ v).transpose(1, 2).reshape(b, n, E)
        x = x + y @ mha.out_proj.weight.double().T + mha.out_proj.bias.double()
    return x


def _inputs():
    x = torch.randn(2, 6, E)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, -2:] = True
    return x, pad


SPECS = {
    "unscaled": ("unscaled", 1.0),
    "float": (0.1, 0.1),
    "standard": ("standard", 1.0 / math.sqrt(E // H)),
    "per_head": (torch.tensor([1.0, 0.5, 0.125, 0.0]), [1.0, 0.5, 0.125, 0.0]),
}
OWN = 1.0 / math.sqrt(E // H)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("name", list(SPECS))
def test_outputs_equal_float64_mha_at_that_scale_and_restored_after(need_weights, name):
    torch.manual_seed(0)
    spec, value = SPECS[name]
    model = Stack(need_weights).eval()
    x, pad = _inputs()
    before = model(x, pad)
    state = module_state(model)
    with probe.scaling(model, spec) as ctx:
        inside = model(x, pad)
        assert is_mode_active(ctx._mode)
    expected = _reference(model, x, pad, {s: value for s in SITES})
    torch.testing.assert_close(inside.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(before.double(), _reference(model, x, pad, {s: OWN for s in SITES}),
                               rtol=1e-5, atol=1e-6)
    if name != "standard":
        assert not torch.allclose(inside, before)
    assert torch.equal(model(x, pad), before)  # exactly the original after exit
    assert hook_count(model) == 0 and not is_mode_active(ctx._mode)
    for (n1, a1, sd1), (n2, a2, sd2) in zip(state, module_state(model)):
        assert n1 == n2 and a1 == a2 and sd1.keys() == sd2.keys()
        assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("name", ["unscaled", "float", "per_head"])
@pytest.mark.parametrize("order", ["probe_outside", "probe_inside"])
def test_probe_reports_the_scale_and_changes_nothing(need_weights, name, order):
    torch.manual_seed(0)
    spec, value = SPECS[name]
    model = Stack(need_weights).eval()
    x, pad = _inputs()
    with probe.scaling(model, spec):
        alone = model(x, pad)
    if order == "probe_outside":
        with probe.watch(model) as p, probe.scaling(model, spec):
            probed = model(x, pad)
    else:
        with probe.scaling(model, spec), probe.watch(model) as p:
            probed = model(x, pad)
    assert torch.equal(probed, alone)  # bitwise: the probe records, it does not change
    s = p.summary()
    for site in SITES:
        info = s.info(site)
        assert info["kind"] == "mha"
        assert info["scale"] == pytest.approx(value)


@pytest.mark.parametrize("need_weights", [False, True])
def test_sites_and_dict_select_mha_sites_by_module_name(need_weights):
    torch.manual_seed(0)
    model = Stack(need_weights).eval()
    x, pad = _inputs()
    with probe.scaling(model, 0.1, sites="layers.1.*") as ctx:
        out = model(x, pad)
    assert ctx._seen == set(SITES)
    expected = _reference(model, x, pad, {SITES[0]: OWN, SITES[1]: 0.1})
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    with probe.scaling(model, {"layers.0.self_attn": "unscaled", "layers.*": 0.3}):
        out = model(x, pad)
    expected = _reference(model, x, pad, {SITES[0]: 1.0, SITES[1]: 0.3})
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("need_weights", [False, True])
def test_one_site_call_per_mha_call_the_inner_sdpa_is_not_counted(need_weights):
    """Each nn.MultiheadAttention call is one site call (#1); the SDPA call inside the mirror is
    neither counted nor rewritten a second time."""
    torch.manual_seed(0)
    model = Stack(need_weights).eval()
    x, pad = _inputs()
    before = model(x, pad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.scaling(model, {"*#2": 0.1}):
            out = model(x, pad)
    assert any("matched none" in str(w.message) for w in caught)
    torch.testing.assert_close(out, before, rtol=1e-5, atol=1e-6)
    with probe.scaling(model, {"*#1": 0.1}):
        out = model(x, pad)
    torch.testing.assert_close(out.double(), _reference(model, x, pad, {s: 0.1 for s in SITES}),
                               rtol=1e-5, atol=1e-6)


def test_transformer_encoder_layers_are_reached_and_restored():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 64, dropout=0.0, batch_first=True),
                                num_layers=2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 5, E)
    before = enc(x)
    with probe.scaling(enc, "unscaled") as ctx:
        out = enc(x)
    assert ctx._seen == {"layers.0.self_attn", "layers.1.self_attn"}
    assert not torch.allclose(out, before, atol=1e-4)
    assert torch.equal(enc(x), before)
