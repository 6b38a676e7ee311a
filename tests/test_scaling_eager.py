"""probe.scaling on eager attention (an explicit softmax over q·kᵀ recognised by probe's eager front
end): outputs equal a float64 computation / the model's SDPA path at the overridden scale, with and
without a probe (which reports that scale), restored on exit, the model untouched; soft-capped
sites are left unchanged with one warning naming the site."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import probe
from probe.capture.mode import is_mode_active
from tests.helpers import hook_count, module_state, tiny_bert, tiny_llama

E, H, D = 32, 4, 8
OWN = 1.0 / math.sqrt(D)


class Eager(nn.Module):
    """One residual eager attention layer: ``style`` picks how the scores are written."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.style = style

    def heads(self, x):
        b, n, _ = x.shape
        return [t.reshape(b, n, H, D).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1)]

    def forward(self, x, mask):
        b, n, _ = x.shape
        q, k, v = self.heads(x)
        if self.style == "plain":  # matmul * s + additive mask
            p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * OWN + mask, dim=-1)
            y = p @ v
        elif self.style == "timm":  # pre-scaled q, boolean mask by masked_fill
            attn = (q * OWN) @ k.transpose(-2, -1)
            attn = attn.masked_fill(mask == float("-inf"), float("-inf"))
            y = attn.softmax(dim=-1) @ v
        elif self.style == "bmm":  # (B*H, L, S) layout, / sqrt(d)
            q3, k3, v3 = (t.reshape(b * H, n, D) for t in (q, k, v))
            s = torch.bmm(q3, k3.transpose(1, 2)) / math.sqrt(D)
            s = s.view(b, H, n, n) + mask
            p = torch.softmax(s.view(b * H, n, n), dim=-1)
            y = torch.bmm(p, v3).view(b, H, n, D)
        else:  # soft cap (Gemma 2): not rewritten
            z = torch.matmul(q, k.transpose(-1, -2)) * OWN
            z = 5.0 * torch.tanh(z / 5.0)
            y = torch.softmax(z + mask, dim=-1) @ v
        return x + y.transpose(1, 2).reshape(b, n, E)

    def reference(self, x, mask, s):
        x, mask = x.double(), mask.double()
        b, n, _ = x.shape
        w, bias = self.qkv.weight.double(), self.qkv.bias.double()
        q, k, v = [t.reshape(b, n, H, D).transpose(1, 2) for t in (x @ w.T + bias).chunk(3, dim=-1)]
        s = torch.as_tensor(s, dtype=torch.float64).reshape(-1, 1, 1)
        p = torch.softmax(s * (q @ k.transpose(-1, -2)) + mask, dim=-1)
        return x + (p @ v).transpose(1, 2).reshape(b, n, E)


class Two(nn.Module):
    def __init__(self, style: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Eager(style), Eager(style)])

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return x

    def reference(self, x, mask, s):
        for layer in self.layers:
            x = layer.reference(x, mask, s)
        return x


def _inputs():
    torch.manual_seed(1)
    x = torch.randn(2, 6, E)
    mask = torch.zeros(2, 1, 1, 6)
    mask[1, ..., -2:] = float("-inf")
    return x, mask


SPECS = {
    "unscaled": ("unscaled", 1.0),
    "float": (0.3, 0.3),
    "standard": ("standard", OWN),
    "per_head": (torch.tensor([1.0, 0.5, 0.125, 0.0]), [1.0, 0.5, 0.125, 0.0]),
}


@pytest.mark.parametrize("attached", [False, True])
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("style", ["plain", "timm", "bmm"])
def test_outputs_equal_float64_at_that_scale_with_and_without_probe(style, name, attached):
    torch.manual_seed(0)
    spec, value = SPECS[name]
    model = Two(style).eval()
    x, mask = _inputs()
    before = model(x, mask)
    state = module_state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if attached:
            with probe.watch(model) as p, probe.scaling(model, spec) as ctx:
                inside = model(x, mask)
        else:
            with probe.scaling(model, spec) as ctx:
                inside = model(x, mask)
                assert is_mode_active(ctx._mode)
    torch.testing.assert_close(inside.double(), model.reference(x, mask, value), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(before.double(), model.reference(x, mask, OWN), rtol=1e-5, atol=1e-5)
    if name != "standard":
        assert not torch.allclose(inside, before)
    if attached:
        s = p.summary()
        for site in ("layers.0", "layers.1"):
            got = s.info(site)["scale"]
            if isinstance(value, list):
                assert list(torch.as_tensor(got, dtype=torch.float64).reshape(-1).tolist()) == pytest.approx(value)
            else:
                assert got == pytest.approx(value, rel=1e-7)
    assert torch.equal(model(x, mask), before)  # exactly the original after exit
    assert hook_count(model) == 0 and not is_mode_active(ctx._mode)
    for (n1, a1, sd1), (n2, a2, sd2) in zip(state, module_state(model)):
        assert n1 == n2 and a1 == a2 and sd1.keys() == sd2.keys()
        assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)


@pytest.mark.parametrize("attached", [False, True])
@pytest.mark.parametrize("name", ["unscaled", "float", "per_head"])
def test_hugging_face_bert_eager_equals_its_sdpa_path_at_that_scale(name, attached):
    spec, _ = SPECS[name]
    eager, sdpa = tiny_bert("eager"), tiny_bert("sdpa")
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    att = torch.ones(2, 7, dtype=torch.long)
    att[1, -3:] = 0
    before = eager(input_ids=ids, attention_mask=att).last_hidden_state
    with probe.scaling(sdpa, spec):
        expected = sdpa(input_ids=ids, attention_mask=att).last_hidden_state
    if attached:
        with probe.watch(eager) as p, probe.scaling(eager, spec):
            got = eager(input_ids=ids, attention_mask=att).last_hidden_state
        got_scale = p.summary().info("encoder.layer.0.attention.self")["scale"]
        want = SPECS[name][1]
        if isinstance(want, list):
            assert torch.as_tensor(got_scale, dtype=torch.float64).reshape(-1).tolist() == pytest.approx(want)
        else:
            assert got_scale == pytest.approx(want, rel=1e-7)
    else:
        with probe.scaling(eager, spec):
            got = eager(input_ids=ids, attention_mask=att).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, before)
    assert torch.equal(eager(input_ids=ids, attention_mask=att).last_hidden_state, before)


@pytest.mark.parametrize("attached", [False, True])
def test_soft_capped_site_left_unchanged_with_one_warning(attached):
    model = Two("softcap").eval()
    x, mask = _inputs()
    before = model(x, mask)
    with pytest.warns(UserWarning, match="NOT rewritten") as record:
        if attached:
            with probe.watch(model), probe.scaling(model, "unscaled"):
                inside = model(x, mask)
                model(x, mask)
        else:
            with probe.scaling(model, "unscaled"):
                inside = model(x, mask)
                model(x, mask)
    assert torch.equal(inside, before)
    left = [str(w.message) for w in record if "NOT rewritten" in str(w.message)]
    assert len(left) == 2 and "'layers.0'" in left[0] and "'layers.1'" in left[1]


def test_nested_contexts_apply_once_and_sites_select():
    model = Two("plain").eval()
    x, mask = _inputs()
    with probe.scaling(model, 0.3), probe.scaling(model, {"layers.1": "unscaled"}):
        got = model(x, mask)
    expected = model.layers[1].reference(model.layers[0].reference(x, mask, 0.3), mask, 1.0)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_hugging_face_llama_eager_grouped_query_equals_its_sdpa_path():
    eager, sdpa = tiny_llama("eager"), tiny_llama("sdpa")
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    for spec in ("unscaled", torch.tensor([1.0, 0.5, 0.25, 0.0])):
        with probe.scaling(sdpa, spec):
            expected = sdpa(input_ids=ids).logits
        with probe.scaling(eager, spec):
            got = eager(input_ids=ids).logits
        with probe.watch(eager), probe.scaling(eager, spec):
            attached = eager(input_ids=ids).logits
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(attached, expected, rtol=1e-5, atol=1e-5)
