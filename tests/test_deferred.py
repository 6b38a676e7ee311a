"""The forward statistics' finishing deferred to the forward's end (probe.session.deferred): the
same values as finished at each call, failures named, QK-Clip's calls finished at once."""

from __future__ import annotations

import warnings

import numpy as np
import torch

import probe
import probe.session.deferred as deferred
from tests.helpers import SDPAModel, watched_once


def _run(model, x, steps=2, **kw):
    with probe.watch(model, **kw) as p:
        for _ in range(steps):
            model(x).square().mean().backward()
    return p.summary()


def _values(s):
    return {(site, m, sc): s.value(site, m, sc) for site in s.sites for m in s.metrics(site) for sc in s.scales(site, m)}


def test_deferred_finishing_reports_what_each_call_finished_alone(monkeypatch):
    torch.manual_seed(0)
    model, x = SDPAModel(layers=3, d_model=32, heads=4, kv_heads=2, causal=True), torch.randn(2, 40, 32)
    counted = []
    real = deferred.finish_fields
    monkeypatch.setattr(deferred, "finish_fields", lambda items, *a: counted.append(len(items)) or real(items, *a))
    on = _values(_run(model, x, rows=16))
    assert counted and max(counted) == 3  # the three layers' calls finished together, at the forward's end
    monkeypatch.setattr(deferred.Deferred, "offer", lambda self, *a: False)  # every call finished at once
    counted.clear()
    off = _values(_run(model, x, rows=16))
    assert not counted and on.keys() == off.keys() and len(on) > 30
    for key, value in on.items():
        np.testing.assert_array_equal(value, off[key], err_msg=str(key))


def test_a_failing_deferred_finishing_names_its_calls_and_training_goes_on(monkeypatch):
    def fails(items, *args):
        raise RuntimeError("rows the reducer cannot read")

    monkeypatch.setattr(deferred, "finish_fields", fails)
    p, _, said = watched_once(SDPAModel(layers=2, d_model=16, heads=2), torch.randn(2, 5, 16))
    messages = [m for m in said if "NOT measured" in m]
    assert any("'layers.0'" in m for m in messages) and any("'layers.1'" in m for m in messages)
    assert all("rows the reducer cannot read" in m for m in messages)
    assert p.summary().sites == []  # nothing half-recorded


def test_calls_qk_clip_reads_are_finished_at_once(monkeypatch):
    offered = []
    real = deferred.Deferred.offer
    monkeypatch.setattr(deferred.Deferred, "offer", lambda self, *a: offered.append(1) or real(self, *a))
    model, x = SDPAModel(layers=2, d_model=16, heads=2), torch.randn(2, 5, 16)
    s = _run(model, x, steps=1, qk_clip=1e9)
    assert not offered and "logit_max" in s.metrics("layers.0")
    _run(model, x, steps=1)
    assert offered  # without QK-Clip the same calls are deferred


def test_rows_beyond_the_budget_are_finished_at_once():
    d = deferred.Deferred(0, None, 0.99, lambda site, message: None)
    rows = type("R", (), {})()
    rows.n = torch.ones(2, 2, 3)
    assert not d.offer(("root", 0), None, {}, rows, None) and not d


def test_deferred_calls_hold_their_rows_not_the_models_tensors():
    """Without autograd a model frees each layer's q, k, v as it goes: the deferred calls must not
    keep them (only per-row statistics, within the budget) until the forward ends."""
    import gc
    import weakref

    model, x = SDPAModel(layers=3, d_model=16, heads=2), torch.randn(2, 24, 16)
    seen = []
    held = {}

    def keep_refs(module, args, out):
        p_rec = held["p"]._rec
        if p_rec.deferred:
            seen.append(len(p_rec.deferred.items))
            for item in p_rec.deferred.items:
                assert not any(isinstance(part, probe.call.AttentionCall) for part in item)
        held.setdefault("outs", []).append(weakref.ref(module.kv.weight))

    for layer in model.layers:
        layer.register_forward_hook(keep_refs)
    kv = []
    for layer in model.layers:
        layer.kv.register_forward_hook(lambda m, a, out: kv.append(weakref.ref(out)))
    with torch.no_grad(), probe.watch(model) as p:
        held["p"] = p
        model(x)
        gc.collect()
    assert seen and max(seen) >= 2  # calls were deferred while the forward ran
    assert all(ref() is None for ref in kv)  # each layer's k, v projection was freed


def test_fields_a_site_cannot_take_are_named_and_the_forward_goes_on(monkeypatch):
    # the merge raising inside the forward's end (a call whose fields do not fit its site's state)
    # reached the model's caller; now the call is named and the site keeps what it had
    import probe.state.accumulator as accumulator

    real = accumulator.merge_states
    seen = []

    def merge(into, new):
        seen.append(1)
        if len(seen) == 3:  # the second step's first call: its site already has a state
            raise RuntimeError("fields of another shape")
        real(into, new)

    monkeypatch.setattr(accumulator, "merge_states", merge)
    torch.manual_seed(0)
    model, x = SDPAModel(layers=2, d_model=16, heads=2), torch.randn(2, 5, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, grads=False, flush_every=10) as p:
            model(x)
            model(x)  # its first call's fields cannot join: named, not raised
        s = p.summary()
    said = [str(w.message) for w in caught if "NOT measured" in str(w.message)]
    assert len(said) == 1 and "'layers.0'" in said[0] and "fields of another shape" in said[0], said
    assert s.sites == ["layers.0", "layers.1"]
