"""Gradient metrics under torch's GradScaler are in the loss's own units (probe.session.loss_scale).

The reference is the same model, inputs and parameters without the scaler: the gradients a
scaled backward sees are ``s`` times those, so every gradient metric must match it (to float64
rounding, exactly for a power-of-two scale), and a backward that overflows must count no step.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import probe

class Attention(nn.Module):
    """Self-attention, through SDPA or an explicit softmax."""

    def __init__(self, d: int = 32, heads: int = 4, eager: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.heads, self.eager = heads, eager

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.eager:
            p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads), dim=-1)
            y = p @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


def _model(eager: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Attention(eager=eager), nn.GELU(), Attention(eager=eager))


def _x(seed: int = 1, n: int = 40) -> torch.Tensor:
    return torch.randn(2, n, 32, generator=torch.Generator().manual_seed(seed))


def _metrics(p: probe.Probe) -> dict:
    s = p.summary()
    return {(site, m, sc): s.value(site, m, sc) for site in s.sites for m in s.metrics(site)
            if m.startswith("grad_") for sc in s.scales(site, m)}


def _run(eager: bool, scaler_kw=None, steps=((1, 1.0),), rows=None, accumulate: int = 1) -> dict:
    """Train ``steps`` (input seed, loss factor) with lr 0 (the parameters never change), the
    loss scaled by a GradScaler made with ``scaler_kw`` (``None``: no scaler)."""
    model = _model(eager)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = None if scaler_kw is None else torch.amp.GradScaler("cpu", **scaler_kw)
    with probe.watch(model, rows=rows) as p:
        for seed, factor in steps:
            for micro in range(accumulate):
                loss = model(_x(seed + 100 * micro)).square().mean() * factor / accumulate
                (loss if scaler is None else scaler.scale(loss)).backward()
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
        return _metrics(p)


def _close(a: dict, b: dict, rtol: float = 1e-12) -> None:
    assert a.keys() == b.keys() and a
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=rtol, atol=0, err_msg=str(key))


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("rows", [None, 8])
def test_scaled_gradients_read_as_unscaled(eager, rows):
    plain = _run(eager, rows=rows)
    assert any(k[1] == "grad_logits_se" for k in plain) == (rows is not None)
    _close(_run(eager, dict(init_scale=2.0**16), rows=rows), plain)  # a power of two: the same numbers
    # another scale: the float32 backward rounds otherwise (2e-6 seen), and the standard errors of
    # these near-equal rows (1e-6 of their estimate) are of that rounding's size: not compared
    other = _run(eager, dict(init_scale=1000.0), rows=rows)
    _close({k: v for k, v in other.items() if k[1] != "grad_logits_se"},
           {k: v for k, v in plain.items() if k[1] != "grad_logits_se"}, rtol=1e-4)


def test_accumulated_micro_batches():
    _close(_run(False, dict(init_scale=2.0**16), accumulate=2), _run(False, accumulate=2))


def test_overflowed_backward_counts_no_step():
    # step 0: the scaled loss overflows (the scaler skips the step and backs off to 2**27);
    # step 1 is then the only gradient step: the metrics are step 1's alone
    scaler_kw = dict(init_scale=2.0**127, backoff_factor=2.0**-100)
    scaled = _run(False, scaler_kw, steps=((1, 1e6), (2, 1.0)))
    _close(scaled, _run(False, steps=((2, 1.0),)))
    for value in scaled.values():
        assert np.isfinite(value).all()


def test_every_backward_overflowed_is_nan_not_zero():
    scaled = _run(False, dict(init_scale=2.0**127, backoff_factor=0.99), steps=((1, 1e6), (2, 1e6)))
    for key, value in scaled.items():
        assert np.isnan(value).all(), key


def test_unscaled_backward_after_a_scaled_one():
    model = _model(False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with probe.watch(model, rows=None) as p:
        scaler.scale(model(_x(1)).square().mean()).backward()
        first = _metrics(p)
        model.zero_grad()
        p.step(1)
        model(_x(1)).square().mean().backward()  # no scaler: the same gradients
        both = _metrics(p)
    for key in first:  # root mean square over two equal steps = each step's value
        np.testing.assert_allclose(both[key], first[key], rtol=1e-12)


def test_scale_restored_when_the_last_probe_closes():
    from torch.amp.grad_scaler import GradScaler

    original = GradScaler.__dict__["scale"]
    a = probe.watch(_model(False))
    b = probe.watch(_model(True))
    assert GradScaler.__dict__["scale"] is not original
    a.close()
    assert GradScaler.__dict__["scale"] is not original  # b is still open
    b.close()
    b.close()  # twice: counted once
    assert GradScaler.__dict__["scale"] is original
    with probe.watch(_model(False), grads=False):
        assert GradScaler.__dict__["scale"] is original  # no gradient metrics: nothing wrapped


def test_disabled_scaler_and_what_scale_returns():
    model = _model(False)
    loss = model(_x()).square().mean()
    with probe.watch(model):
        off = torch.amp.GradScaler("cpu", enabled=False)
        assert off.scale(loss) is loss
        on = torch.amp.GradScaler("cpu", init_scale=4.0)
        pair = on.scale([loss, (loss,)])
        assert isinstance(pair, list) and isinstance(pair[1], tuple)
        assert torch.equal(pair[0], loss * 4) and torch.equal(pair[1][0], loss * 4)
        lazy = on.scale(iter([loss]))  # a lazy iterable stays lazy (not read by probe)
        assert torch.equal(next(iter(lazy)), loss * 4)


def test_no_warning_and_training_unchanged():
    torch.manual_seed(0)
    ref, watched = _model(False), _model(False)
    for model, watch in ((ref, False), (watched, True)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            p = probe.watch(model) if watch else None
            for seed in range(3):
                scaler.scale(model(_x(seed)).square().mean()).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            if p is not None:
                p.close()
    for a, b in zip(ref.parameters(), watched.parameters()):
        assert torch.equal(a, b)


def test_fsdp_sharded_scaler_also_when_imported_later():
    # a fresh process: FSDP's scaler class is defined (imported) after the probe opened
    code = """
import sys, torch, probe
sys.path.insert(0, {root!r})
from tests.test_loss_scale import _model, _x
model = _model(False)
with probe.watch(model, rows=None) as p:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    ShardedGradScaler(device="cpu", init_scale=2.0**16).scale(model(_x(1)).square().mean()).backward()
    scaled = p.summary().value("0", "grad_q")
assert not getattr(ShardedGradScaler.scale, "__probe_wrapped__", False)  # put back
from torch.amp.grad_scaler import GradScaler
assert "__init_subclass__" not in GradScaler.__dict__
model = _model(False)
with probe.watch(model, rows=None) as p:
    model(_x(1)).square().mean().backward()
    plain = p.summary().value("0", "grad_q")
assert (scaled == plain).all(), (scaled, plain)
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    done = subprocess.run([sys.executable, "-c", code.format(root=root)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_failure_at_the_backward_end_never_breaks_training(monkeypatch):
    import probe.session.loss_scale as loss_scale

    def broken(self, held, factor):
        raise RuntimeError("boom")

    monkeypatch.setattr(loss_scale.ScaledFields, "_settle", broken)
    model, ref = _model(False), _model(False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    ref_scaler.scale(ref(_x()).square().mean()).backward()
    with pytest.warns(RuntimeWarning, match="loss-scaled backward were not recorded"):
        with probe.watch(model):
            scaler.scale(model(_x()).square().mean()).backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant):
    """Reentrant checkpointing recomputes the calls inside the scaled backward: unscaled too."""
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertModel

    def run(scale):
        torch.manual_seed(0)
        model = BertModel(BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, attn_implementation="sdpa", hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        ids = torch.randint(0, 100, (2, 64), generator=torch.Generator().manual_seed(1))
        scaler = torch.amp.GradScaler("cpu", init_scale=scale, enabled=scale is not None)
        with probe.watch(model, rows=None) as p:
            scaler.scale(model(input_ids=ids).last_hidden_state.square().mean()).backward()
            return _metrics(p)

    plain = run(None)
    assert sum(k[1] == "grad_q" for k in plain) == 2  # both layers' gradients measured
    _close(run(2.0**16), plain)
