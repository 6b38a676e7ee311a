"""Backward metrics against autograd and plain float64 references.

* ``grad_q/k/v``: per-head norms of ``.grad`` on leaf q, k, v.
* ``grad_logits@actual``: the norm of the gradient of the explicit logits in an eager float64
  re-implementation of the attention (autograd through ``softmax(Z) @ v``).
* ``grad_logits`` at other scales: a softmax-Jacobian product ``(diag(p) - p pᵀ) dP`` written
  row by row in numpy, with ``dP = dO · vᵀ`` from the same upstream gradient.
"""

from __future__ import annotations

import math
from typing import Dict

import numpy as np
import pytest
import torch

import probe
from tests.helpers import OneCall
from probe.call import AttentionCall
from probe.stats.backward import grad_logits_stats, head_sq
from probe.stats.reference import grad_logits_chunk


def _leaves(b=2, h=4, hk=None, l=7, s=None, d=16):
    hk, s = hk or h, s or l
    return [torch.randn(*shape).requires_grad_() for shape in ((b, h, l, d), (b, hk, s, d), (b, hk, s, d))]


def _valid(b, h, l, s, mask=None, bias=None, causal=False) -> torch.Tensor:
    valid = torch.ones(b, h, l, s, dtype=torch.bool)
    if causal:
        valid &= torch.ones(l, s, dtype=torch.bool).tril()
    if mask is not None:
        valid &= mask.expand(b, h, l, s)
    if bias is not None:
        valid &= (bias > torch.finfo(bias.dtype).min / 2).expand(b, h, l, s)
    return valid


def _run_backward(q, k, v, w, **kwargs):
    """Probe one SDPA call, backpropagate ``sum(out * w)``; returns the summary."""
    model = OneCall(q, k, v, **kwargs)
    with probe.watch(model, scales={"half": lambda d: 0.5 / math.sqrt(d)}) as p:
        out = model()
        (out * w).sum().backward()
    return p.summary()


# -- the references, written plainly --------------------------------------------------------
def eager_logit_grad_norms(q, k, v, scale, valid, bias, w) -> np.ndarray:
    """‖∂L/∂Z‖ per head, from autograd through an explicit float64 attention, L = Σ out ⊙ w."""
    groups = q.shape[1] // k.shape[1]
    q64, w64 = q.detach().double(), w.double()
    k64 = k.detach().double().repeat_interleave(groups, dim=1)
    v64 = v.detach().double().repeat_interleave(groups, dim=1)
    z = scale * q64 @ k64.transpose(-1, -2)
    if bias is not None:
        z = z + bias.double()
    z = z.masked_fill(~valid, -math.inf).requires_grad_()
    out = torch.softmax(z, dim=-1) @ v64
    (out * w64).sum().backward()
    g = torch.where(valid, z.grad, 0.0)
    return g.square().sum((0, 2, 3)).sqrt().numpy()


def jacobian_logit_grad_norms(q, k, v, scale, valid, bias, dout, softcap=None, dp=None) -> np.ndarray:
    """‖(diag(p) − p pᵀ) dP‖ per head, row by row in numpy, dP = dO · vᵀ held fixed (or ``dp``)."""
    q64, k64, v64 = (t.detach().double().numpy() for t in (q, k, v))
    do64 = dout.detach().double().numpy()
    dp64 = None if dp is None else dp.detach().double().numpy()
    b_, h_, l_, _ = q64.shape
    groups = h_ // k64.shape[1]
    valid = np.broadcast_to(valid.numpy(), (b_, h_, l_, k64.shape[2]))
    bias64 = None if bias is None else np.broadcast_to(bias.detach().double().numpy(), valid.shape)
    total = np.zeros(h_)
    for b in range(b_):
        for h in range(h_):
            kh, vh = k64[b, h // groups], v64[b, h // groups]
            sigma = float(scale[h]) if isinstance(scale, torch.Tensor) else scale
            for i in range(l_):
                keys = np.nonzero(valid[b, h, i])[0]
                if keys.size == 0:
                    continue
                z = sigma * (kh[keys] @ q64[b, h, i])
                if softcap is not None:
                    z = softcap * np.tanh(z / softcap)
                if bias64 is not None:
                    z = z + bias64[b, h, i, keys]
                p = np.exp(z - z.max())
                p /= p.sum()
                jac = np.diag(p) - np.outer(p, p)
                dp = vh[keys] @ do64[b, h, i] if dp64 is None else dp64[b, h, i, keys]
                g = jac @ dp
                total[h] += g @ g
    return np.sqrt(total)


def _head_norms(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().square().sum((0, 2, 3)).sqrt().numpy()


def _check_all(s, q, k, v, w, valid, bias, actual):
    site = s.sites[0]
    np.testing.assert_allclose(s.value(site, "grad_q"), _head_norms(q.grad), rtol=1e-4)
    np.testing.assert_allclose(s.value(site, "grad_k"), _head_norms(k.grad), rtol=1e-4)
    np.testing.assert_allclose(s.value(site, "grad_v"), _head_norms(v.grad), rtol=1e-4)
    np.testing.assert_allclose(
        s.value(site, "grad_logits"), eager_logit_grad_norms(q, k, v, actual, valid, bias, w), rtol=1e-4
    )
    d = q.shape[-1]
    for name, sigma in {"unscaled": 1.0, "standard": d**-0.5, "half": 0.5 * d**-0.5, "actual": actual}.items():
        ref = jacobian_logit_grad_norms(q, k, v, sigma, valid, bias, w)
        np.testing.assert_allclose(s.value(site, "grad_logits", name), ref, rtol=1e-4, err_msg=name)


# -- against the references -----------------------------------------------------------------
def test_plain_and_explicit_scale():
    q, k, v = _leaves()
    w = torch.randn(2, 4, 7, 16)
    s = _run_backward(q, k, v, w, scale=0.3)
    _check_all(s, q, k, v, w, _valid(2, 4, 7, 7), None, 0.3)


@pytest.mark.parametrize("l,s", [(7, 7), (4, 9)])
def test_causal(l, s):
    q, k, v = _leaves(l=l, s=s)
    w = torch.randn(2, 4, l, 16)
    summary = _run_backward(q, k, v, w, is_causal=True)
    _check_all(summary, q, k, v, w, _valid(2, 4, l, s, causal=True), None, 0.25)


def test_boolean_padding_mask():
    q, k, v = _leaves(l=6)
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    mask[0, ..., 4:] = False
    mask[1, ..., 1:] = False  # one valid key per row: P = 1, no gradient to the logits
    w = torch.randn(2, 4, 6, 16)
    s = _run_backward(q, k, v, w, attn_mask=mask)
    _check_all(s, q, k, v, w, _valid(2, 4, 6, 6, mask=mask), None, 0.25)


def test_hf_style_float_mask_with_bias():
    q, k, v = _leaves(l=5, s=9)
    bias = torch.randn(2, 1, 5, 9) * 0.5
    bias[0, :, :, 6:] = torch.finfo(torch.float32).min
    w = torch.randn(2, 4, 5, 16)
    s = _run_backward(q, k, v, w, attn_mask=bias)
    valid = _valid(2, 4, 5, 9, bias=bias)
    _check_all(s, q, k, v, w, valid, torch.where(valid, bias, 0.0), 0.25)


def test_gqa_causal_and_masked():
    q, k, v = _leaves(h=8, hk=2, l=6)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    mask[1, :, :, 0] = False
    mask[1, :, 0, 0] = True  # row 0 keeps its only causal key
    w = torch.randn(2, 8, 6, 16)
    s = _run_backward(q, k, v, w, attn_mask=mask, enable_gqa=True)
    site = s.sites[0]
    assert s.value(site, "grad_q").shape == (8,) and s.value(site, "grad_k").shape == (2,)
    assert s.info(site)["grad_kv_heads"] == 2
    _check_all(s, q, k, v, w, _valid(2, 8, 6, 6, mask=mask), None, 0.25)

    q, k, v = _leaves(h=8, hk=2, l=6)
    s = _run_backward(q, k, v, w, is_causal=True, enable_gqa=True)
    _check_all(s, q, k, v, w, _valid(2, 8, 6, 6, causal=True), None, 0.25)


def test_per_head_scale_softcap_and_fully_masked_rows_in_the_pure_function():
    q, k, v = (t.detach() for t in _leaves(h=4, hk=2, l=5, s=6))
    dout = torch.randn(2, 4, 5, 16)
    mask = torch.ones(2, 1, 5, 6, dtype=torch.bool)
    mask[0, :, 2] = False  # a fully masked row: no NaN, no gradient
    sigma = torch.tensor([0.1, 0.25, 0.5, -0.3])
    call = AttentionCall(q=q, k=k, v=v, scale=sigma, mask=mask, softcap=2.0)
    fields = grad_logits_stats(call, dout, {"actual": sigma, "unscaled": 1.0, "one": 1.0})
    assert set(fields) == {"grad_logits_sq@actual", "grad_logits_sq@unscaled", "grad_logits_sq@one"}
    valid = _valid(2, 4, 5, 6, mask=mask)
    for name, s in (("actual", sigma), ("unscaled", 1.0)):
        ref = jacobian_logit_grad_norms(q, k, v, s, valid, None, dout, softcap=2.0)
        np.testing.assert_allclose(fields[f"grad_logits_sq@{name}"].sqrt().numpy(), ref, rtol=1e-4, err_msg=name)
    assert torch.equal(fields["grad_logits_sq@unscaled"], fields["grad_logits_sq@one"])


def test_eager_softmax_output_hook_is_exact_with_dropout_and_a_bmm_layout():
    """With the softmax output in the record, its hook receives dP = ∂L/∂P itself, dropout mask
    and 1/(1-p) included (which ∂L/∂out · vᵀ would miss), here in a (B·H, L, S) bmm layout."""
    from probe.session.recorder import GradHooks

    q, k, v = _leaves(l=5, s=6)
    mask = torch.ones(2, 1, 5, 6, dtype=torch.bool)
    mask[0, :, :, 4:] = False
    w = torch.randn(2, 4, 5, 16)
    keep = (torch.rand(2, 4, 5, 6) > 0.3) / 0.7  # an explicit dropout mask, the same for the reference
    z = (0.3 * q @ k.transpose(-1, -2)).masked_fill(~mask, -math.inf).reshape(8, 5, 6)
    probs = torch.softmax(z, dim=-1)  # (B·H, L, S), as a bmm-based model has it
    out = torch.bmm(probs * keep.reshape(8, 5, 6), v.reshape(8, 6, 16)).reshape(2, 4, 5, 16)

    fields: Dict[str, torch.Tensor] = {}
    def add(key, step, new):
        for name, value in new.items():
            fields[name] = value if name not in fields else fields[name] + value

    hooks = GradHooks(add, warn=pytest.fail)
    call = AttentionCall(q=q, k=k, v=v, scale=0.3, mask=mask, output=out, probs=probs, kind="eager")
    assert hooks.register(call, "site", 0, {"actual": 0.3, "unscaled": 1.0}, 2**20) == 4  # probs, q, k, v
    (out * w).sum().backward()
    hooks.remove()

    valid = _valid(2, 4, 5, 6, mask=mask)
    dp = keep * (w @ v.detach().transpose(-1, -2))
    for name, sigma in (("actual", 0.3), ("unscaled", 1.0)):
        ref = jacobian_logit_grad_norms(q, k, v, sigma, valid, None, w, dp=dp)
        np.testing.assert_allclose(fields[f"grad_logits_sq@{name}"].sqrt().numpy(), ref, rtol=1e-4, err_msg=name)
    np.testing.assert_allclose(fields["grad_q_sq"].sqrt().numpy(), _head_norms(q.grad), rtol=1e-4)
    np.testing.assert_allclose(fields["grad_k_sq"].sqrt().numpy(), _head_norms(k.grad), rtol=1e-4)
    np.testing.assert_allclose(fields["grad_v_sq"].sqrt().numpy(), _head_norms(v.grad), rtol=1e-4)


def test_eager_call_with_unknown_scale_reports_actual_from_its_own_logits():
    from probe.session.recorder import GradHooks

    q, k, v = _leaves(l=5)
    w = torch.randn(2, 4, 5, 16)
    z = q @ k.transpose(-1, -2) * 0.2 - 3.0  # a shift the eager front end cannot describe
    z = z.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    probs = torch.softmax(z, dim=-1)
    fields: Dict[str, torch.Tensor] = {}
    hooks = GradHooks(lambda key, step, new: fields.update(new), warn=pytest.fail)
    call = AttentionCall(q=q, k=k, v=None, scale=None, logits=z, probs=probs, kind="eager")
    hooks.register(call, "site", 0, {"actual": None, "unscaled": 1.0, "standard": 0.25}, 2**20)
    (probs @ v.detach() * w).sum().backward()
    hooks.remove()
    assert [f for f in fields if f.startswith("grad_logits")] == ["grad_logits_sq@actual"]
    ref = eager_logit_grad_norms(q, k, v, 0.2, _valid(2, 4, 5, 5, causal=True), None, w)
    np.testing.assert_allclose(fields["grad_logits_sq@actual"].sqrt().numpy(), ref, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_model_is_reduced_in_float32(dtype):
    """The model runs in half precision; probe upcasts q, k, v, dO and reduces in float32. The
    reference sees the same half-precision values (and autograd's half-precision .grad)."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in _leaves(h=4, hk=2, l=6))
    w = torch.randn(2, 4, 6, 16).to(dtype)
    s = _run_backward(q, k, v, w, is_causal=True, enable_gqa=True)
    site, valid = s.sites[0], _valid(2, 4, 6, 6, causal=True)
    np.testing.assert_allclose(s.value(site, "grad_q"), _head_norms(q.grad), rtol=1e-3)
    np.testing.assert_allclose(s.value(site, "grad_k"), _head_norms(k.grad), rtol=1e-3)
    ref = jacobian_logit_grad_norms(q, k, v, 1.0, valid, None, w.float())
    np.testing.assert_allclose(s.value(site, "grad_logits", "unscaled"), ref, rtol=1e-3)


def test_chunking_gives_the_same_result_as_one_chunk():
    q, k, v = (t.detach() for t in _leaves(l=33, s=20))
    dout = torch.randn(2, 4, 33, 16)
    bias = torch.randn(2, 4, 33, 20)
    call = AttentionCall(q=q, k=k, v=v, scale=0.25, bias=bias, causal=True)
    scales = {"actual": 0.25, "unscaled": 1.0}
    whole = grad_logits_stats(call, dout, scales, budget_bytes=2**30)
    rowwise = grad_logits_stats(call, dout, scales, budget_bytes=1)  # one query row per chunk
    for field in whole:
        torch.testing.assert_close(rowwise[field], whole[field], rtol=1e-5, atol=0)


def test_head_sq_matches_plain_sum_and_upcasts_half():
    g = torch.randn(2, 3, 5, 8)
    torch.testing.assert_close(head_sq(g), g.double().square().sum((0, 2, 3)), rtol=1e-5, atol=0)
    big = torch.full((1, 2, 4, 4), 300.0, dtype=torch.float16)  # 300² overflows float16
    torch.testing.assert_close(head_sq(big), torch.full((2,), 16 * 300.0**2, dtype=torch.float64))


def test_float64_model_gets_grad_metrics():
    """A float64 model's gradients are reduced in float64 (the norm refuses to narrow)."""
    q, k, v = (t.detach().double().requires_grad_() for t in _leaves(h=4, hk=2, l=6))
    w = torch.randn(2, 4, 6, 16, dtype=torch.float64)
    s = _run_backward(q, k, v, w, is_causal=True, enable_gqa=True)
    site = s.sites[0]
    np.testing.assert_allclose(s.value(site, "grad_q"), _head_norms(q.grad), rtol=1e-6)
    np.testing.assert_allclose(s.value(site, "grad_v"), _head_norms(v.grad), rtol=1e-6)


def test_unscaled_gradient_vanishes_at_dk_256():
    """The seed's claim: without 1/sqrt(d_k) the softmax saturates and passes back almost nothing.

    With unit-variance q, k and d_k = 256 the unscaled logits have standard deviation 16; with a
    handful of keys nearly every row is one-hot, so ``∂L/∂Z`` (same upstream gradient) is a
    fraction of what the standard scale passes back.
    """
    torch.manual_seed(1)
    q, k, v = _leaves(b=2, h=2, l=64, s=4, d=256)
    w = torch.randn(2, 2, 64, 256)
    s = _run_backward(q, k, v, w)
    site = s.sites[0]
    unscaled, standard = s.value(site, "grad_logits", "unscaled"), s.value(site, "grad_logits", "standard")
    assert (unscaled < 0.5 * standard).all(), (unscaled, standard)
    assert (s.value(site, "saturation", "unscaled") > 0.6).all()  # ~0.7: most rows are one-hot
    # the model's own (standard) scale is what "actual" reports
    np.testing.assert_array_equal(s.value(site, "grad_logits", "actual"), standard)


def test_norm_is_dominated_by_near_tie_rows_at_long_sequences():
    """What the Frobenius norm does not say (docs/gradients.md): with many keys the typical
    unscaled row passes back several times less than at the standard scale, yet the few rows where two
    keys nearly tie (Jacobian entries up to 1/4 instead of about 1/S) make the norm no smaller."""
    torch.manual_seed(0)
    d, keys = 256, 128
    q, k, v, dout = torch.randn(2, 2, 64, d), torch.randn(2, 2, keys, d), torch.randn(2, 2, keys, d), torch.randn(2, 2, 64, d)
    call = AttentionCall(q=q, k=k, v=v, scale=d**-0.5)
    fields = grad_logits_stats(call, dout, {"unscaled": 1.0, "standard": d**-0.5})
    assert (fields["grad_logits_sq@unscaled"] > fields["grad_logits_sq@standard"]).all()
    R, dP = q @ k.transpose(-1, -2), dout @ v.transpose(-1, -2)
    medians = []
    for sigma in (1.0, d**-0.5):
        p = torch.softmax(sigma * R, -1)
        medians.append((p * (dP - (p * dP).sum(-1, keepdim=True))).norm(dim=-1).median())
    assert medians[0] < 0.25 * medians[1]  # ~0.14 here


def test_backward_reductions_run_on_meta_tensors():
    """No .item(), no data-dependent shapes in the backward reductions."""
    q = torch.empty(2, 8, 300, 64, device="meta")
    k = torch.empty(2, 2, 300, 64, device="meta")
    v = torch.empty(2, 2, 300, 32, device="meta")
    dout = torch.empty(2, 8, 300, 32, device="meta")
    bias = torch.empty(2, 1, 300, 300, device="meta")
    mask = torch.empty(2, 1, 1, 300, dtype=torch.bool, device="meta")
    call = AttentionCall(q=q, k=k, v=v, scale=0.125, bias=bias, mask=mask, causal=True, softcap=30.0)
    fields = grad_logits_stats(call, dout, {"actual": 0.125, "unscaled": 1.0, "x": torch.ones(8, device="meta")},
                               budget_bytes=2**20)
    assert set(fields) == {"grad_logits_sq@actual", "grad_logits_sq@unscaled", "grad_logits_sq@x"}
    assert all(t.device.type == "meta" and t.shape == (8,) for t in fields.values())
    assert head_sq(k).device.type == "meta" and head_sq(k).shape == (2,)
    r = torch.empty(1, 8, 4, 300, device="meta")
    assert grad_logits_chunk(r, None, None, r, 1.0).shape == (8,)
