"""probe.scaling: outputs equal SDPA at the overridden scale, restored on exit, per-head scales,
site selection, probe reports the overridden scale, bad input."""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe
from probe.capture.mode import is_mode_active
from tests.helpers import SDPAModel, hook_count, module_state, tiny_llama

D, H = 64, 4  # d_k = 16


def _mask(b: int, n: int) -> torch.Tensor:
    m = torch.ones(b, 1, n, n, dtype=torch.bool)
    m[1, :, :, -2:] = False  # padding of the second sequence
    return m


CASES = {
    "plain": (dict(), False),
    "causal": (dict(causal=True), False),
    "masked": (dict(), True),
    "gqa": (dict(kv_heads=2, causal=True), False),
}


def _pair(kw, scale):
    """The model, and a copy with the same weights whose attention uses ``scale`` itself."""
    model = SDPAModel(**kw)
    twin = SDPAModel(**{**kw, "scale": scale})
    twin.load_state_dict(model.state_dict())
    return model.eval(), twin.eval()


def _run(model, x, mask):
    return model(x, mask) if mask is not None else model(x)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("spec,value", [("unscaled", 1.0), (0.1, 0.1), ("standard", 16**-0.5)])
def test_outputs_equal_sdpa_at_that_scale_exactly_and_restored_after(case, spec, value):
    kw, masked = CASES[case]
    model, twin = _pair({**kw, "scale": 0.5}, value)  # the model's own scale is 0.5
    x = torch.randn(2, 6, D)
    mask = _mask(2, 6) if masked else None
    before = _run(model, x, mask)
    state = module_state(model)
    with probe.scaling(model, spec) as ctx:
        inside = _run(model, x, mask)
        assert is_mode_active(ctx._mode)
    assert torch.equal(inside, _run(twin, x, mask))
    assert not torch.equal(inside, before)
    assert torch.equal(_run(model, x, mask), before)
    assert not is_mode_active(ctx._mode) and hook_count(model) == 0
    after = module_state(model)
    for (n1, attrs1, sd1), (n2, attrs2, sd2) in zip(state, after):
        assert n1 == n2 and attrs1 == attrs2 and sd1.keys() == sd2.keys()
        assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)


@pytest.mark.parametrize("order", ["probe_outside", "probe_inside"])
def test_probe_reports_the_overridden_scale_as_actual_in_either_nesting(order):
    model, twin = _pair(dict(causal=True), 1.0)
    x = torch.randn(2, 6, D)
    if order == "probe_outside":
        with probe.watch(model) as p, probe.scaling(model, "unscaled"):
            out = model(x)
    else:
        with probe.scaling(model, "unscaled"), probe.watch(model) as p:
            out = model(x)
    assert torch.equal(out, twin(x))  # applied once, not twice
    s = p.summary()
    with probe.watch(twin) as pt:
        twin(x)
    t = pt.summary()
    for site in ("layers.0", "layers.1"):
        assert s.info(site)["scale"] == 1.0
        for metric in ("logit_var", "logit_max", "entropy", "saturation"):
            np.testing.assert_allclose(s.value(site, metric), t.value(site, metric), rtol=1e-6)
        # the counterfactuals are still of the same q, k: "standard" is 1/sqrt(16)
        np.testing.assert_allclose(s.value(site, "logit_var", "standard"),
                                   s.value(site, "logit_var") / 16, rtol=1e-5)


def _manual_per_head(q, k, v, scales, valid):
    """softmax(s_h q kᵀ) v per head, float64, plainly."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64)
    for h in range(q.shape[1]):
        logits = scales[h] * q[:, h] @ k[:, h // groups].transpose(-1, -2)
        logits = logits.masked_fill(~valid, float("-inf"))
        out[:, h] = torch.softmax(logits, dim=-1) @ v[:, h // groups]
    return out


class Bare(nn.Module):
    def __init__(self, causal: bool, gqa: bool) -> None:
        super().__init__()
        self.causal, self.gqa = causal, gqa

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal, enable_gqa=self.gqa)


@pytest.mark.parametrize("causal,gqa,masked", [(False, False, False), (True, False, False),
                                               (False, False, True), (True, True, False)])
def test_per_head_tensor_matches_a_manual_per_head_computation(causal, gqa, masked):
    q = torch.randn(2, 4, 5, 8)
    k, v = torch.randn(2, 2 if gqa else 4, 5, 8), torch.randn(2, 2 if gqa else 4, 5, 8)
    scales = torch.tensor([1.0, 0.5, 0.125, 0.0])
    valid = torch.ones(2, 5, 5, dtype=torch.bool)
    if causal:
        valid = valid & torch.ones(5, 5, dtype=torch.bool).tril()
    mask = None
    if masked:
        valid = valid.clone()
        valid[0, :, 3:] = False
        mask = valid[:, None]
    model = Bare(causal, gqa)
    with probe.scaling(model, scales):
        out = model(q, k, v, mask)
    expected = _manual_per_head(q, k, v, scales.tolist(), valid)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    with probe.watch(model) as p, probe.scaling(model, scales):
        again = model(q, k, v, mask)
    assert torch.equal(again, out)
    assert p.summary().info("root")["scale"] == scales.tolist()
    # logit_var@actual is each head's own s_h² · var(R)
    raw = p.summary().value("root", "logit_var", "unscaled")
    np.testing.assert_allclose(p.summary().value("root", "logit_var"), raw * scales.numpy() ** 2, rtol=1e-5)


def test_sites_filter_and_dict_of_sites():
    model, twin = _pair(dict(causal=True), 1.0)
    x = torch.randn(2, 6, D)
    with torch.no_grad():
        h0 = model.layers[0](model.norm(x))
        with probe.scaling(model, "unscaled", sites="layers.1"):
            y = model(x)
    # layer 0 unchanged, layer 1 unscaled: rebuild by hand from the two models' layers
    x1 = x + h0
    expected = x1 + twin.layers[1](twin.norm(x1))
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    with probe.watch(model) as p, probe.scaling(model, {"layers.0": 0.05, "layers.*": "unscaled"}):
        model(x)
    s = p.summary()
    assert s.info("layers.0")["scale"] == 0.05 and s.info("layers.1")["scale"] == 1.0
    with pytest.warns(UserWarning, match="'nope.*' matched none"):
        with probe.scaling(model, {"nope.*": 2.0, "layers.0": "actual"}):
            model(x)


def test_nested_contexts_innermost_wins_and_other_models_untouched():
    model, _ = _pair(dict(), 1.0)
    other = Bare(False, False)
    x = torch.randn(2, 6, D)
    q = torch.randn(1, 4, 3, 8)
    with probe.watch(model) as p, probe.scaling(model, 0.3), probe.scaling(model, 0.7, sites="layers.1"):
        model(x)
        assert torch.equal(other(q, q, q), F.scaled_dot_product_attention(q, q, q))
    s = p.summary()
    assert s.info("layers.0")["scale"] == pytest.approx(0.3) and s.info("layers.1")["scale"] == pytest.approx(0.7)


def test_hugging_face_llama_unscaled_and_restored():
    model = tiny_llama()
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        before = model(ids).logits
        with probe.watch(model) as p, probe.scaling(model, "unscaled"):
            inside = model(ids).logits
        after = model(ids).logits
    assert torch.equal(after, before) and not torch.allclose(inside, before)
    s = p.summary()
    assert [s.info(site)["scale"] for site in s.sites] == [1.0, 1.0]


@pytest.mark.parametrize("scale,match", [
    ("half", "`scale`.*got 'half'"),
    (-1.0, "`scale`.*got -1.0"),
    (float("nan"), "`scale`.*got nan"),
    (torch.tensor([1.0, float("nan")]), "finite scales >= 0"),
    (torch.ones(2, 2), "shape \\(2, 2\\)"),
    ([1.0], "got list"),
    ({"layers.0": "tiny"}, "scale\\['layers.0'\\]"),
])
def test_bad_scales_raise_probe_error_naming_them(scale, match):
    with pytest.raises(probe.ProbeError, match=match):
        probe.scaling(SDPAModel(), scale)


def test_wrong_tensor_length_named_during_forward_and_cleanup():
    model = SDPAModel()
    with pytest.raises(probe.ProbeError, match="one value per head of site 'layers.0' \\(4\\), got 3"):
        with probe.scaling(model, torch.ones(3)) as ctx:
            model(torch.randn(1, 3, D))
    assert not is_mode_active(ctx._mode)
    assert not probe.experiment.scaling.active()
    with pytest.raises(probe.ProbeError, match="`model`"):
        probe.scaling("model", 1.0)
    with pytest.raises(probe.ProbeError, match="`sites=`, got both"):
        probe.scaling(model, {"a": 1.0}, sites="a")


def test_no_host_sync_on_meta_tensors():
    """The override path reads no tensor value (a .item() or bool(t) would fail on meta)."""
    model = Bare(causal=True, gqa=True)
    q = torch.empty(2, 4, 5, 8, device="meta")
    k = v = torch.empty(2, 2, 5, 8, device="meta")
    with probe.scaling(model, torch.tensor([1.0, 0.5, 0.25, 0.125])):
        assert model(q, k, v).device.type == "meta"
    with probe.scaling(model, "standard", sites="root"):
        assert model(q, k, v).shape == (2, 4, 5, 8)


class MHAModel(nn.Module):
    def __init__(self, need_weights: bool) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.need_weights = need_weights

    def forward(self, x):
        return self.mha(x, x, x, need_weights=self.need_weights)[0]


@pytest.mark.parametrize("need_weights", [False, True])
def test_calls_a_front_end_makes_internally_are_not_overridden_again(need_weights):
    """nn.MultiheadAttention runs at the override once: the SDPA call its front end makes inside
    the mirror is not rewritten a second time (probe would record one scale and run another, and
    attaching a probe would change the outputs). More in tests/test_scaling_mha.py."""
    model = MHAModel(need_weights).eval()
    x = torch.randn(2, 5, 32)
    before = model(x)
    with probe.scaling(model, "unscaled"):
        alone = model(x)
    with probe.watch(model) as p, probe.scaling(model, "unscaled"):
        probed = model(x)
    assert torch.equal(probed, alone) and not torch.allclose(alone, before)
    assert torch.equal(model(x), before)
    assert p.summary().info("mha")["scale"] == 1.0
