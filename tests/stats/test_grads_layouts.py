"""The backward's per-call reductions on the layouts models hand them (Hugging Face's q, k, v
and their gradients are transposed views of ``(B, L, H, d)``), at extreme magnitudes, against
float64 references."""

from __future__ import annotations

import math

import pytest
import torch

from probe.call import AttentionCall
from probe.stats.backward import grad_logits_stats, grad_scale, head_sq
from tests.helpers import masked_logits64


def _hf_layout(b, h, l, d, gen, dtype=torch.float32):
    """A ``(B, H, L, d)`` transposed view of a contiguous ``(B, L, H, d)`` tensor."""
    return torch.randn(b, l, h, d, generator=gen).to(dtype).transpose(1, 2)


def _row_bound(d):
    """The relative error of a float32 sum of ``d`` squares, square-rooted and squared again
    (positive terms: at most ``(d + 2)·2⁻²⁴``), with one unit to spare."""
    return (d + 3) * 2.0**-24


@pytest.mark.parametrize("magnitude", [1e-30, 1e-19, 1.0, 1e19, 1e30])
def test_head_sq_is_exact_on_transposed_gradients_of_any_magnitude(magnitude):
    """Float32 squares underflow below ~1e-19 and overflow above ~1.8e19: such rows are taken
    in float64, so every magnitude gives the float64 sum of squares; rows of ordinary size are
    float32 sums of squares (within their rounding bound), added in float64."""
    gen = torch.Generator().manual_seed(0)
    g = _hf_layout(2, 4, 33, 16, gen) * magnitude
    assert not g.is_contiguous()
    ref = g.double().square().sum((0, 2, 3))
    rtol = _row_bound(16) if magnitude == 1.0 else 1e-12
    torch.testing.assert_close(head_sq(g), ref, rtol=rtol, atol=0)
    torch.testing.assert_close(head_sq(g.contiguous()), ref, rtol=rtol, atol=0)


def test_head_sq_reads_a_float32_gradient_once_without_a_float64_copy(monkeypatch):
    seen = []
    norm = torch.linalg.vector_norm

    def spy(x, *args, **kwargs):
        seen.append((tuple(x.shape), kwargs.get("dtype")))
        return norm(x, *args, **kwargs)

    g = _hf_layout(2, 4, 300, 64, torch.Generator().manual_seed(7))
    ref = g.double().square().sum((0, 2, 3))
    monkeypatch.setattr(torch.linalg, "vector_norm", spy)
    torch.testing.assert_close(head_sq(g), ref, rtol=_row_bound(64), atol=0)
    assert seen == [((2, 300, 4, 64), None)]  # one float32 pass, in memory order


def test_head_sq_takes_heads_of_tiny_or_nonfinite_rows_in_float64():
    """Zero rows (padded keys get no gradient) beside ordinary ones stay on the float32 pass; a
    head whose every row is below float32's squares keeps its float64 value, a huge entry its
    float64 square, NaN and inf their head."""
    gen = torch.Generator().manual_seed(5)
    g = _hf_layout(2, 4, 40, 16, gen)
    g[:, 1, 3:] = 0.0  # head 1: zero rows but three
    ref = g.double().square().sum((0, 2, 3))
    torch.testing.assert_close(head_sq(g), ref, rtol=_row_bound(16), atol=0)
    g[:, 0] *= 1e-25  # head 0: every row tiny
    g[0, 2, 5, 1] = 1e30  # head 2: one huge entry (its row overflows in float32)
    ref = g.double().square().sum((0, 2, 3))
    out = head_sq(g)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=0)  # the float64 path
    assert ref[0] > 0 and ref[2] > 1e60
    g[1, 3, 7, 0] = math.inf
    assert head_sq(g)[3] == math.inf
    g[1, 3, 7, 0] = math.nan
    assert math.isnan(head_sq(g)[3])


def test_head_sq_of_a_huge_bfloat16_gradient_does_not_overflow():
    g = torch.full((1, 2, 3, 4), 3e38, dtype=torch.bfloat16)
    torch.testing.assert_close(head_sq(g), g.double().square().sum((0, 2, 3)), rtol=1e-12, atol=0)


def test_head_sq_keeps_nan_and_inf_of_their_head():
    g = torch.ones(1, 3, 2, 4)
    g[0, 0, 1, 2] = math.nan
    g[0, 1, 0, 0] = math.inf
    out = head_sq(g)
    assert math.isnan(out[0]) and out[1] == math.inf and out[2] == 8.0


def test_grad_scale_brings_the_largest_entry_into_one_two_on_any_layout():
    gen = torch.Generator().manual_seed(1)
    for magnitude in (1e-30, 3e-7, 1.0, 5e3, 1e30):
        g = _hf_layout(2, 3, 17, 8, gen) * magnitude
        s = grad_scale(g)
        assert s.dtype == torch.float32 and s.shape == ()
        assert torch.log2(s) == torch.round(torch.log2(s))  # a power of two: scales exactly
        top = (g.double().abs().max() * s.double()).item()
        assert 1.0 <= top < 2.0, (magnitude, top)
        assert grad_scale(g.contiguous()) == s
    assert grad_scale(torch.tensor([-3.0, 2.0]).half()) == 0.5  # the most negative entry counts


@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf, 0.0])
def test_grad_scale_is_one_for_zero_or_non_finite_gradients(special):
    g = torch.zeros(1, 2, 3, 4)
    g[0, 1, 2, 3] = special
    assert grad_scale(g) == 1.0


def _device_formula(g):
    """grad_scale's tensor formula (the accelerators' path, no host read) on a CPU tensor."""
    top = torch.maximum(g.amax(), -g.amin()).float()
    exponent = torch.floor(torch.log2(top))
    ok = torch.isfinite(exponent)
    return torch.where(ok, torch.exp2(-torch.where(ok, exponent, 0.0).clamp_(min=-126)), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_grad_scale_read_on_the_host_equals_the_device_formula(dtype):
    """On CPUs the scale is computed on the host from the largest magnitude (ten tensor
    operations fewer per call); it is the same power of two as the device path's."""
    values = [0.0, 1e-45, 1e-40, 2.0**-126, 3e-20, 0.75, 1.0, 1.5, 2.0, 3.0, 1e30, 3e38, math.inf, math.nan]
    if dtype == torch.float64:
        values += [1e-300, 1e300]
    for v in values:
        for sign in (1.0, -1.0):
            g = torch.tensor([0.5 * v, sign * v, -0.25 * v], dtype=torch.float64).to(dtype)
            got, want = grad_scale(g), _device_formula(g)
            assert got.dtype == torch.float32 and got.shape == ()
            assert got == want, (dtype, sign * v, got, want)


def test_grad_scale_is_float32_whatever_the_default_dtype():
    """The host-computed scale is made as float32 like the device path's, also under
    ``torch.set_default_dtype(torch.float64)``."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        s = grad_scale(torch.tensor([3.0, -1.0], dtype=torch.float32))
    finally:
        torch.set_default_dtype(before)
    assert s.dtype == torch.float32 and s == 0.5


def test_grad_scale_of_an_empty_gradient_is_one():
    assert grad_scale(torch.zeros(2, 0, 3, 4)) == 1.0


@pytest.mark.parametrize("rows", [None, torch.tensor([0, 3, 4, 9, 12])])
@pytest.mark.parametrize("causal,kv_heads", [(False, 4), (True, 2)])
def test_grad_logits_of_a_huge_transposed_output_gradient_is_the_scaled_exact_value(rows, causal, kv_heads):
    """``∂L/∂Z`` is linear in ``∂L/∂out``: a gradient 2^100 times larger (its squares overflow
    float32) gives sums exactly 2^200 times larger, from Hugging Face's layouts."""
    gen = torch.Generator().manual_seed(2)
    q = _hf_layout(2, 4, 13, 8, gen)
    k, v = _hf_layout(2, kv_heads, 13, 8, gen), _hf_layout(2, kv_heads, 13, 8, gen)
    dout = _hf_layout(2, 4, 13, 8, gen)
    call = AttentionCall(q=q, k=k, v=v, scale=0.35, causal=causal)
    scales = {"actual": 0.35, "unscaled": 1.0}
    unit = grad_logits_stats(call, dout, scales, rows=rows)
    huge = grad_logits_stats(call, dout * 2.0**100, scales, rows=rows)
    assert set(unit) == set(huge) and unit
    for name in unit:
        power = 400 if name.startswith("grad_logits_var") else 200
        torch.testing.assert_close(huge[name], unit[name] * 2.0**power, rtol=1e-12, atol=0)
        assert torch.isfinite(huge[name]).all()


def _grad_logits64(q, k, v, dout, scale, causal, key_mask=None):
    """Per-head ``Σ (∂L/∂Z)²`` in float64 (kv heads repeated), the softmax Jacobian written out."""
    z, valid = masked_logits64(q, k, scale, causal, key_mask)
    p = torch.softmax(torch.where(valid, z, -math.inf), -1).nan_to_num(0.0)
    dp = dout.double() @ v.double().repeat_interleave(q.shape[1] // v.shape[1], 1).transpose(-1, -2)
    return (p * (dp - (p * dp).sum(-1, keepdim=True))).square().sum((0, 2, 3))


@pytest.mark.parametrize("causal,kv_heads,padded", [(False, 4, True), (True, 2, False), (True, 1, True)])
@pytest.mark.parametrize("logit_scale,offset", [(1.0, 0.0), (6.0, 0.0), (1.0, 50.0)])
def test_grad_logits_matches_float64_on_transposed_inputs(causal, kv_heads, padded, logit_scale, offset):
    """Every row, Hugging Face's layouts, GQA, causal and padding masks; large logits (near
    one-hot rows) and a ``dP`` with a large common offset (``dP − rowsum(P ⊙ dP)`` cancels)."""
    gen = torch.Generator().manual_seed(3)
    b, h, l, d = 2, 4, 40, 16
    q = _hf_layout(b, h, l, d, gen) * logit_scale
    k, v = _hf_layout(b, kv_heads, l, d, gen), _hf_layout(b, kv_heads, l, d, gen)
    v = v + offset / d  # dP = dout · vᵀ gets a common offset along each row
    dout = _hf_layout(b, h, l, d, gen) + 1.0
    key_mask = None
    if padded:
        key_mask = torch.ones(b, 1, l, l, dtype=torch.bool)
        key_mask[1, ..., l - 9:] = False
    call = AttentionCall(q=q, k=k, v=v, scale=0.25, causal=causal, mask=key_mask)
    fields = grad_logits_stats(call, dout, {"actual": 0.25, "unscaled": 1.0}, budget_bytes=2**12)  # several chunks
    for name, sigma in (("actual", 0.25), ("unscaled", 1.0)):
        ref = _grad_logits64(q, k, v, dout, sigma, causal, key_mask)
        torch.testing.assert_close(fields[f"grad_logits_sq@{name}"], ref, rtol=2e-4, atol=0)


def test_head_sq_upcasts_chunks_of_rows_not_the_whole_gradient(monkeypatch):
    """The norm's ``dtype=float64`` copies its input first: a whole large gradient took twice its
    size in extra memory; rows now go in chunks of at most 2 MiB (or the budget), same values."""
    seen = []
    norm = torch.linalg.vector_norm

    def spy(x, *args, **kwargs):
        seen.append(x.numel() * 8)
        return norm(x, *args, **kwargs)

    gen = torch.Generator().manual_seed(4)
    g = _hf_layout(1, 8, 1500, 64, gen) * 1e25  # 3 MiB in float32, 6 MiB upcast; squares overflow float32
    ref = g.double().square().sum((0, 2, 3))
    monkeypatch.setattr(torch.linalg, "vector_norm", spy)
    torch.testing.assert_close(head_sq(g), ref, rtol=1e-12, atol=0)
    seen.pop(0)  # the float32 pass over rows (no copy), which found every row overflowing
    assert len(seen) > 1 and max(seen) <= 2 * 2**20
    seen.clear()
    torch.testing.assert_close(head_sq(g, budget_bytes=10_000), ref, rtol=1e-12, atol=0)
    assert max(seen[1:]) <= 10_000
    seen.clear()
    torch.testing.assert_close(head_sq(g, budget_bytes=1), ref, rtol=1e-12, atol=0)  # one row at a time
    assert max(seen[1:]) == 8 * 64 * 8


def test_recorder_hands_the_memory_budget_to_head_sq(monkeypatch):
    import probe
    import probe.session.grad_hooks
    from tests.helpers import SDPAAttention

    budgets = []
    real = probe.session.grad_hooks.head_sq
    monkeypatch.setattr(probe.session.grad_hooks, "head_sq", lambda g, budget: budgets.append(budget) or real(g, budget))
    model = SDPAAttention(d_model=16, heads=2)
    with probe.watch(model, every=1, memory_budget=123_456):
        model(torch.randn(2, 5, 16)).sum().backward()
    assert budgets and set(budgets) == {123_456}


def test_a_vanishing_output_gradient_keeps_finite_gradient_sums():
    """An output gradient of subnormal float32 entries (~1e-40, a vanishing gradient) got the
    scale 2^133, which is inf in float32, and NaN sums; the scale is capped at 2^126, and the sums
    are the linear rescaling of an ordinary gradient's (to the precision subnormals keep)."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=gen) for _ in range(3))
    call = AttentionCall(q=q, k=k, v=v, scale=0.5)
    dout = torch.randn(1, 2, 9, 4, generator=gen)
    s = grad_scale(dout * 1e-40)
    assert s == 2.0**126
    base = grad_logits_stats(call, dout, {"actual": 0.5})["grad_logits_sq@actual"]
    tiny = 2.0**-140  # exact in float32 (subnormal): the sums scale by 2^-280
    got = grad_logits_stats(call, dout * tiny, {"actual": 0.5})["grad_logits_sq@actual"]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got * 2.0**280, base, rtol=1e-3, atol=0)
