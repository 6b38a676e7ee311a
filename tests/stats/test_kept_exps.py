"""What the forward keeps for the backward (``plan.keep``): the sampled rows' exponentials, or
with every row each row's max. The same ``grad_logits`` as recomputing, used when kept, taken by
the backward, and bounded."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe
import probe.session.recorder as recorder
import probe.stats.plan as plan_module
from probe.stats import buffers
from probe.call import AttentionCall
from probe.stats.backward import grad_logits_stats
from probe.stats.forward import forward_fields
from probe.stats.paths import centred, shifted
from probe.stats.plan import plan_call
from probe.stats.sampling import row_design
from tests.stats.test_rows_sampling_grads import _case as _grad_case

SCALES = {"actual": 0.5, "none": 1.0, "standard": 8**-0.5}


def _case(length, causal, padded, kv_heads, seed=0):
    """(call, ∂L/∂out, float64 per-row Σ(∂L/∂Z)² at the actual scale 0.5): the sampled-rows tests' case."""
    return _grad_case(length, causal, padded, kv_heads, seed)


def _planned(call, positions, keep_bytes):
    # chunks of 8 rows, so that causal calls gather their rows in several batches
    call, plan = plan_call(call, SCALES, 2**20, positions, keep_bytes=keep_bytes)
    return call, dataclasses.replace(plan, step=8)


@pytest.mark.parametrize("causal,padded,kv_heads", [(False, False, 6), (False, True, 2), (True, False, 3), (True, True, 3)])
def test_kept_exponentials_give_the_recomputed_gradients(monkeypatch, causal, padded, kv_heads):
    monkeypatch.setattr(centred, "_FLUSH_ROWS", 3)  # causal: a batch of rows once 3 are gathered
    call, dout, y = _case(40, causal, padded, kv_heads)
    positions = torch.tensor([0, 3, 4, 9, 17, 18, 25, 31, 38, 39])
    call, kept = _planned(call, positions, keep_bytes=2**30)
    assert kept.path == "centred" and kept.keep and kept.step < 40
    forward_fields(call, kept)
    batches, sums = kept.carry["exps"]
    assert sum(e.shape[3] for _, e in batches) == positions.shape[0] and sums.shape == (3, 2, 6, 10)
    if causal:
        assert len(batches) > 1  # rows gathered over several chunks, each batch over its keys
    got = grad_logits_stats(call, dout, SCALES, plan=kept)
    assert not kept.carry  # taken by the backward
    # the float64 reference: the sampled rows' sums weighted by the design
    weight = row_design(positions, 40)[0]
    reference = (y[:, :, positions] * weight).sum((0, 2))
    torch.testing.assert_close(got["grad_logits_sq@actual"], reference, rtol=1e-4, atol=0)
    _, plain = _planned(call, positions, keep_bytes=0)
    assert not plain.keep
    forward_fields(call, plain)
    assert not plain.carry
    want = grad_logits_stats(call, dout, SCALES, plan=plain)
    assert set(got) == set(want) and any(k.startswith("grad_logits_var@") for k in got)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=0)
    # a second backward through the same call recomputes: the same numbers
    again = grad_logits_stats(call, dout, SCALES, plan=kept)
    for key in want:
        torch.testing.assert_close(again[key], want[key], rtol=1e-5, atol=0)


def test_the_backward_uses_what_the_forward_kept():
    """Kept exponentials doubled on one row batch change the result: the backward read them."""
    call, dout, _ = _case(40, True, True, 3)
    positions = torch.tensor([2, 5, 11, 30])
    call, kept = _planned(call, positions, keep_bytes=2**30)
    forward_fields(call, kept)
    honest = grad_logits_stats(call, dout, SCALES, plan=kept)
    forward_fields(call, kept)
    batches, sums = kept.carry["exps"]
    batches[0][1].mul_(3.0)  # e three times larger, Σe as it was: ‖e ⊙ (dP − c)‖² / (Σe)² grows
    tampered = grad_logits_stats(call, dout, SCALES, plan=kept)
    assert (tampered["grad_logits_sq@actual"] > 1.5 * honest["grad_logits_sq@actual"]).all()


def test_the_next_forward_keeps_into_the_memory_a_backward_handed_back(monkeypatch):
    """The kept exponentials' memory goes back to the pool once the backward read it, and the
    next forward keeps into it (the same addresses) with the same numbers as fresh memory."""
    buffers.drop_kept()
    call, dout, _ = _case(40, True, True, 3)
    positions = torch.tensor([2, 5, 11, 30])
    call, kept = _planned(call, positions, keep_bytes=2**30)
    forward_fields(call, kept)
    first = {e.data_ptr() for _, e in kept.carry["exps"][0]}
    want = grad_logits_stats(call, dout, SCALES, plan=kept)
    assert {t.data_ptr() for t in buffers._POOL.free} == first  # handed back
    forward_fields(call, kept)  # stale contents in the reused memory
    assert {e.data_ptr() for _, e in kept.carry["exps"][0]} == first and not buffers._POOL.free
    again = grad_logits_stats(call, dout, SCALES, plan=kept)
    for key in want:
        torch.testing.assert_close(again[key], want[key], rtol=0, atol=0)
    # bounded: nothing is pooled beyond KEPT_POOL_BYTES, and drop_kept releases what is
    monkeypatch.setattr(buffers, "KEPT_POOL_BYTES", 0)
    forward_fields(call, kept)
    grad_logits_stats(call, dout, SCALES, plan=kept)
    assert not buffers._POOL.free
    monkeypatch.undo()
    forward_fields(call, kept)
    grad_logits_stats(call, dout, SCALES, plan=kept)
    assert buffers._POOL.free
    buffers.drop_kept()
    assert not buffers._POOL.free


def test_closing_a_probe_releases_the_pooled_memory(monkeypatch):
    model = _Stack()
    with probe.watch(model, rows=16, memory_budget=2**21):
        model().backward()
        assert buffers._POOL.free  # the backward handed the kept memory back
    assert not buffers._POOL.free


def test_a_plan_keeps_only_within_its_bounds(monkeypatch):
    call, _, _ = _case(40, False, True, 2)
    positions = torch.tensor([1, 7, 20])
    _, plan = _planned(call, positions, keep_bytes=2**30)
    need = plan.kept_bytes(2, 6)
    assert need == 3 * 2 * 6 * 3 * 40 * 4  # three distinct scales (0.5, 1, 8**-0.5), every key
    assert _planned(call, positions, keep_bytes=need)[1].keep
    assert not _planned(call, positions, keep_bytes=need - 1)[1].keep
    every = _planned(call, None, keep_bytes=2**30)[1]  # every row: only each row's max
    assert every.keep and every.kept_bytes(2, 6) == 2 * 6 * 40 * 4
    monkeypatch.setattr(plan_module, "KEEP_EXPS_BYTES", need - 1)
    assert not _planned(call, positions, keep_bytes=2**30)[1].keep
    biased = AttentionCall(q=call.q, k=call.k, v=call.v, scale=0.5, bias=torch.zeros(1, 1, 40, 40))
    assert not _planned(biased, positions, keep_bytes=2**30)[1].keep  # the general path keeps nothing


class _Stack(nn.Module):
    """Three causal SDPA calls on learned q, k, v (a backward reaches each)."""

    def __init__(self, length=64):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.qkv = nn.ParameterList(nn.Parameter(torch.randn(1, 4, length, 8, generator=gen)) for _ in range(9))

    def forward(self):
        out = 0.0
        for i in range(3):
            q, k, v = self.qkv[3 * i : 3 * i + 3]
            out = out + F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum()
        return out


def _grad_logits(monkeypatch, keep_limit, share=0.5, no_grad=False):
    monkeypatch.setattr(plan_module, "KEEP_EXPS_BYTES", keep_limit)
    monkeypatch.setattr(recorder, "KEEP_SHARE", share)
    used = []
    original = shifted._kept_rows
    monkeypatch.setattr(shifted, "_kept_rows", lambda *a, **k: used.append(1) or original(*a, **k))
    model = _Stack()
    with probe.watch(model, rows=16, memory_budget=2**21) as p:
        if no_grad:
            with torch.no_grad():
                model()
        model().backward()
    s = p.summary()
    return {site: s.value(site, "grad_logits") for site in s.sites}, len(used)


def test_the_recorder_keeps_within_its_share_of_the_memory_budget(monkeypatch):
    # each call keeps 2 scales x 4 heads x 16 rows x 64 keys x 4 bytes = 32 KiB
    plain, used = _grad_logits(monkeypatch, 0)
    assert used == 0
    every, used = _grad_logits(monkeypatch, 2**20)
    assert used == 3
    two, used = _grad_logits(monkeypatch, 2**20, share=2.5 * 32 * 2**10 / 2**21)  # room for two calls
    assert used == 2
    for site, value in plain.items():
        torch.testing.assert_close(torch.as_tensor(every[site]), torch.as_tensor(value), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.as_tensor(two[site]), torch.as_tensor(value), rtol=1e-5, atol=0)
        assert math.isfinite(float(value.sum()))


def test_a_forward_without_grad_keeps_nothing(monkeypatch):
    kept = []
    original = plan_module.plan_call

    def spy(*args, **kwargs):
        kept.append(kwargs.get("keep_bytes", 0))
        return original(*args, **kwargs)

    monkeypatch.setattr(recorder, "plan_call", spy)
    _grad_logits(monkeypatch, 2**20, no_grad=True)
    assert kept[:3] == [0, 0, 0] and all(b > 0 for b in kept[3:6])


@pytest.mark.parametrize("causal,padded,kv_heads,path", [(False, True, 2, "centred"), (True, False, 3, "centred"),
                                                          (True, True, 6, "centred"), (True, True, 3, "key_blocks"),
                                                          (False, True, 2, "key_blocks")])
def test_every_row_backward_takes_the_forwards_row_max(causal, padded, kv_heads, path):
    call, dout, _ = _case(40, causal, padded, kv_heads)
    if path == "centred":
        call, kept = _planned(call, None, keep_bytes=2**30)
    else:  # a budget small enough for blocks of keys
        call, kept = plan_call(call, SCALES, 2**16, None, keep_bytes=2**30)
    assert kept.path == path and kept.keep and kept.kept_bytes(2, 6) == 2 * 6 * 40 * 4
    forward_fields(call, kept)
    assert set(kept.carry) == {"rmax"} and kept.carry["rmax"].shape == (2, 6, 40)
    got = grad_logits_stats(call, dout, SCALES, plan=kept)
    assert not kept.carry
    plain = dataclasses.replace(kept, keep=False, carry={})
    forward_fields(call, plain)
    assert not plain.carry
    want = grad_logits_stats(call, dout, SCALES, plan=plain)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=0)
    # the backward shifts by the kept max: far above every logit, every exponential underflows
    forward_fields(call, kept)
    kept.carry["rmax"].add_(1e4)
    shifted_far = grad_logits_stats(call, dout, SCALES, plan=kept)
    assert (shifted_far["grad_logits_sq@actual"] == 0).all() and (want["grad_logits_sq@actual"] > 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_a_carried_row_max_that_the_backward_exceeds_falls_back_to_its_own(causal):
    """Every row exact (``rows=None``): the forward hands each row's max to the backward, which
    shifts its float32 ``R`` by it. Logits near 1e9 round by ~1e3 there, so at the unscaled scale
    ``exp2(σ·(R − r))`` overflowed (NaN, where the model's own gradient is finite); such a call is
    computed again with each chunk's own max. At the call's small scale (σR ~ 1) the carried max
    is kept and matches float64."""
    from probe.stats import forward

    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, 4, 48, 16, generator=g) * 1e4 for _ in range(2))
    v, dout = torch.randn(2, 4, 48, 16, generator=g), torch.randn(2, 4, 48, 16, generator=g)
    call = AttentionCall(q=q, k=k, v=v, scale=1e-9, causal=causal)
    scales = {"actual": 1e-9, "unscaled": 1.0}
    call, carried = plan_call(call, scales, rows=None, keep_bytes=2**26)
    assert carried.keep and carried.path == "centred"
    forward.forward_rows(call, carried)
    assert "rmax" in carried.carry
    got = grad_logits_stats(call, dout, scales, plan=carried)
    _, fresh = plan_call(call, scales, rows=None)
    want = grad_logits_stats(call, dout, scales, plan=fresh)
    for key in want:
        assert torch.isfinite(got[key]).all(), key
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-30, msg=key)
    z = (q.double() @ k.double().transpose(-1, -2)) * 1e-9
    if causal:
        z = z.masked_fill(~torch.ones(48, 48, dtype=torch.bool).tril(), -math.inf)
    p = torch.softmax(z, -1)
    dP = dout.double() @ v.double().transpose(-1, -2)
    ref = (p * (dP - (p * dP).sum(-1, keepdim=True))).square().sum((0, 2, 3))
    torch.testing.assert_close(got["grad_logits_sq@actual"], ref, rtol=1e-4, atol=0)
