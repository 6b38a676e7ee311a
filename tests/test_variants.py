"""probe.variants: exact at initialisation, removable, trainable, per-head and per-key-position
semantics against a float64 reference, interplay with probe.watch and probe.scaling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe
from probe import variants
from tests.helpers import SDPAModel, hook_count, tiny_llama

D = 64  # 4 heads, d_k = 16

CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "gqa": dict(kv_heads=2, causal=True),
    "scaled": dict(scale=0.3),
}


# SDPA forbids attn_mask together with is_causal: masked cases only for non-causal models.
COMBOS = [(c, m) for c in CASES for m in (False, True) if not (m and CASES[c].get("causal"))]


def _mask(b: int, n: int) -> torch.Tensor:
    m = torch.ones(b, 1, n, n, dtype=torch.bool)
    m[1, :, :, -2:] = False
    return m


def _install(kind, model, example):
    if kind == "headwise":
        return variants.headwise(model, example)
    return variants.scale_bias(model, example, max_len=8)


def _out_and_grads(model, x, mask=None):
    model.zero_grad(set_to_none=True)
    out = model(x, mask)
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if not n.endswith(("probe_scale", "probe_bias"))}


@pytest.mark.parametrize("case,masked", COMBOS)
def test_headwise_at_init_is_bitwise_the_model_outputs_and_gradients(case, masked):
    model = SDPAModel(**CASES[case])
    x = torch.randn(2, 6, D)
    mask = _mask(2, 6) if masked else None
    out0, grads0 = _out_and_grads(model, x, mask)
    handle = variants.headwise(model, (x, mask))
    out1, grads1 = _out_and_grads(model, x, mask)
    assert torch.equal(out1, out0)
    assert all(torch.equal(grads0[n], grads1[n]) for n in grads0)
    handle.remove()


@pytest.mark.parametrize("case,masked", COMBOS)
def test_scale_bias_at_init_computes_what_the_model_did(case, masked):
    model = SDPAModel(**CASES[case])
    x = torch.randn(2, 6, D)
    mask = _mask(2, 6) if masked else None
    with torch.no_grad():
        before = model(x, mask)
    out0, grads0 = _out_and_grads(model, x, mask)
    handle = variants.scale_bias(model, (x, mask), max_len=8)
    with torch.no_grad():  # same kernel path as the model's call: bitwise
        assert torch.equal(model(x, mask), before)
    # With grad, SDPA takes its math kernel for a mask that needs a gradient: equal to rounding.
    out1, grads1 = _out_and_grads(model, x, mask)
    torch.testing.assert_close(out1, out0, rtol=1e-6, atol=1e-6)
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-5, atol=1e-7)
    handle.remove()


@pytest.mark.parametrize("kind", ["headwise", "scale_bias"])
def test_install_then_remove_leaves_state_dict_and_outputs_as_before(kind):
    model = SDPAModel(causal=True)
    x = torch.randn(2, 6, D)
    keys = list(model.state_dict())
    with torch.no_grad():
        before = model(x)
    hooks = hook_count(model)
    handle = _install(kind, model, x)
    assert handle.sites == ["layers.0", "layers.1"]
    new = [k for k in model.state_dict() if k not in keys]
    expected = ["layers.0.probe_scale", "layers.1.probe_scale"]
    if kind == "scale_bias":
        expected += ["layers.0.probe_bias", "layers.1.probe_bias"]
    assert sorted(new) == sorted(expected)
    with torch.no_grad():
        model.layers[0].probe_scale.mul_(2.0)  # make it compute something else
        assert not torch.equal(model(x), before)
    handle.remove()
    handle.remove()  # twice is harmless
    assert list(model.state_dict()) == keys and hook_count(model) == hooks
    assert not hasattr(model.layers[0], "probe_scale")
    with torch.no_grad():
        assert torch.equal(model(x), before)


@pytest.mark.parametrize("kind", ["headwise", "scale_bias"])
def test_a_training_step_updates_the_variant_parameters(kind):
    model = SDPAModel(causal=True)
    x = torch.randn(4, 6, D)
    target = torch.randn(4, 6, D)
    handle = _install(kind, model, x)
    params = handle.parameters()
    assert all(any(p is q for q in model.parameters()) for p in params)  # the optimizer sees them
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = [p.detach().clone() for p in params]
    F.mse_loss(model(x), target).backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in params)
    opt.step()
    assert all(not torch.equal(b, p.detach()) for b, p in zip(before, params))
    model.double()  # .to() moves them with the model
    assert all(p.dtype == torch.float64 for p in handle.parameters())
    model(x.double())
    handle.remove()


def _reference(q, k, v, scales, bias=None, valid=None):
    """softmax(s_h q kᵀ + b[h, j]) v over valid keys, float64, per head."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64)
    for h in range(q.shape[1]):
        z = scales[h] * q[:, h] @ k[:, h // groups].transpose(-1, -2)
        if bias is not None:
            z = z + bias[h, : k.shape[2]].double()
        if valid is not None:
            z = z.masked_fill(~valid, float("-inf"))
        out[:, h] = torch.softmax(z, -1) @ v[:, h // groups]
    return out


class Bare(nn.Module):
    def __init__(self, causal: bool = False, gqa: bool = False) -> None:
        super().__init__()
        self.causal, self.gqa = causal, gqa

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal, enable_gqa=self.gqa)


@pytest.mark.parametrize("causal,gqa,masked", [(False, False, False), (True, True, False), (False, False, True)])
def test_learned_scales_and_biases_against_a_float64_reference(causal, gqa, masked):
    q = torch.randn(2, 4, 5, 8)
    k, v = torch.randn(2, 2 if gqa else 4, 5, 8), torch.randn(2, 2 if gqa else 4, 5, 8)
    valid = torch.ones(2, 5, 5, dtype=torch.bool)
    if causal:
        valid = valid & torch.ones(5, 5, dtype=torch.bool).tril()
    mask = None
    if masked:
        valid = valid.clone()
        valid[1, :, 3:] = False
        mask = valid[:, None]
    model = Bare(causal, gqa)
    handle = variants.scale_bias(model, (q, k, v, mask), max_len=7)
    assert handle.sites == ["root"]
    torch.testing.assert_close(handle.scales()["root"], torch.full((4,), 8**-0.5))
    scales = torch.tensor([0.1, 0.5, 1.0, 2.0])
    bias = torch.randn(4, 7)
    with torch.no_grad():
        model.probe_scale.copy_(scales)
        model.probe_bias.copy_(bias)
        out = model(q, k, v, mask)
        torch.testing.assert_close(out.double(), _reference(q, k, v, scales, bias, valid), rtol=1e-5, atol=1e-6)
        # a bias constant along a row changes nothing
        model.probe_bias.copy_(torch.arange(4.0)[:, None].expand(4, 7))
        torch.testing.assert_close(model(q, k, v, mask).double(), _reference(q, k, v, scales, None, valid),
                                   rtol=1e-5, atol=1e-6)
    handle.remove()


def test_probe_records_the_learned_scale_and_scaling_overrides_it():
    model = SDPAModel(causal=True)
    x = torch.randn(2, 6, D)
    handle = variants.headwise(model, x)
    learned = torch.tensor([0.1, 0.2, 0.3, 0.4])
    with torch.no_grad():
        model.layers[1].probe_scale.copy_(learned)
    with probe.watch(model) as p:
        model(x)
    s = p.summary()
    assert s.info("layers.0")["scale"] == [0.25] * 4
    np.testing.assert_allclose(s.info("layers.1")["scale"], learned.numpy(), rtol=1e-6)
    raw = s.value("layers.1", "logit_var", "unscaled")
    np.testing.assert_allclose(s.value("layers.1", "logit_var"), raw * learned.numpy() ** 2, rtol=1e-5)
    # probe.scaling's scale replaces the learned one; the variant is back afterwards
    twin = SDPAModel(causal=True, scale=1.0)
    twin.load_state_dict({k: v for k, v in model.state_dict().items() if "probe_" not in k})
    with torch.no_grad():
        with probe.scaling(model, "unscaled"):
            assert torch.equal(model(x), twin(x))
        with probe.watch(model) as p2:
            model(x)
    np.testing.assert_allclose(p2.summary().info("layers.1")["scale"], learned.numpy(), rtol=1e-6)
    handle.remove()


def test_hugging_face_llama_headwise_exact_and_removable():
    model = tiny_llama()
    ids = torch.randint(0, 64, (2, 7))
    keys = list(model.state_dict())
    with torch.no_grad():
        before = model(ids).logits
        handle = variants.headwise(model, ids)
        assert handle.sites == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
        assert torch.equal(model(ids).logits, before)
        handle.remove()
        assert list(model.state_dict()) == keys and torch.equal(model(ids).logits, before)


def test_bad_input_raises_probe_error():
    model = SDPAModel()
    x = torch.randn(1, 6, D)
    with pytest.raises(probe.ProbeError, match="`max_len` to be a positive int, got 0"):
        variants.scale_bias(model, x, max_len=0)
    with pytest.raises(probe.ProbeError, match="`example`"):
        variants.headwise(model, 3.0)
    with pytest.raises(probe.ProbeError, match="`sites` to match.*layers.0, layers.1"):
        variants.headwise(model, x, sites="encoder.*")
    with pytest.raises(probe.ProbeError, match="`model`"):
        variants.headwise("model", x)
    handle = variants.scale_bias(model, x, max_len=6)
    with pytest.raises(probe.ProbeError, match="already has `probe_scale`"):
        variants.headwise(model, x)
    with pytest.raises(probe.ProbeError, match="at most `max_len`=6 key positions at site 'layers.0', got 9"):
        model(torch.randn(1, 9, D))
    assert not probe.experiment.scaling.active()  # nothing left registered after the error
    handle.remove()
    assert hook_count(model) == 0


def test_no_host_sync_on_meta_tensors():
    """Installed and run on meta tensors: the variant's forward reads no tensor value."""
    model = Bare(causal=True, gqa=True)
    q = torch.empty(2, 4, 5, 8, device="meta", requires_grad=True)
    k = v = torch.empty(2, 2, 5, 8, device="meta")
    handle = variants.scale_bias(model, (q, k, v), max_len=5)
    assert model.probe_bias.device.type == "meta"
    out = model(q, k, v)
    out.sum().backward()
    assert out.device.type == "meta" and model.probe_scale.grad.shape == (4,)
    handle.remove()


def test_variant_under_gradient_checkpointing_and_a_probe_gives_the_same_gradients():
    model = tiny_llama().train()
    ids = torch.randint(0, 64, (2, 7))
    handle = variants.scale_bias(model, ids, max_len=16)
    with torch.no_grad():
        for p in handle.parameters():
            p.add_(torch.randn_like(p) * 0.1)

    def grads():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    model.config.use_cache = False
    # the attention forward re-runs inside backward; transformers before 5.2x (what pip picks on
    # Python 3.9 and 3.10) names it gradient_checkpointing_enable
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    with probe.watch(model) as p:
        checkpointed = grads()
    assert all(torch.equal(plain[n], checkpointed[n]) for n in plain)
    assert bool(plain["model.layers.0.self_attn.probe_bias"].abs().sum() > 0)
    s = p.summary()
    np.testing.assert_allclose(s.info("model.layers.0.self_attn")["scale"],
                               handle.scales()["model.layers.0.self_attn"].numpy(), rtol=1e-6)
    assert "grad_q" in s.metrics("model.layers.0.self_attn")
    handle.remove()


def test_trained_variant_round_trips_through_state_dict():
    """Install on a fresh model first, then load: the variant's parameters are ordinary keys."""
    model = SDPAModel(causal=True)
    x = torch.randn(2, 6, D)
    handle = variants.scale_bias(model, x, max_len=8)
    with torch.no_grad():
        for p in handle.parameters():
            p.add_(torch.randn_like(p))
        expected = model(x)
    fresh = SDPAModel(causal=True)
    again = variants.scale_bias(fresh, x, max_len=8)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(x), expected)
    for site, value in handle.scales().items():
        assert torch.equal(again.scales()[site], value)
    handle.remove()
    again.remove()
