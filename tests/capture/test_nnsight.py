"""nnsight's tracing contexts over a watched model (skipped without nnsight).

``NNsight(model).trace(x)`` runs the model's own modules with nnsight's hooks: probe measures the
attention as without nnsight, and an intervention on a module's output (nnsight's in-place
``output[:] = ...``) gives the values of the same edit made by a forward hook; the scale of q and
k written into a tensor is named unknown, not guessed.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import probe
from tests.test_loss_scale import _model, _x

nnsight = pytest.importorskip("nnsight")


def _values(p: probe.Probe) -> dict:
    s = p.summary()
    return {(site, m): s.value(site, m) for site in s.sites for m in ("entropy", "logit_var", "max_prob")}


def test_a_trace_is_measured_as_the_plain_forward():
    model = _model(True)
    with probe.watch(model, rows=None) as p:
        model(_x(1))
        plain = _values(p)
    traced = nnsight.NNsight(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, rows=None) as p:
            with traced.trace(_x(1)):
                traced[0].output.save()
            got = _values(p)
    assert not [w for w in caught if "probe" in str(w.message)]
    assert got.keys() == plain.keys()
    for key in plain:
        np.testing.assert_array_equal(got[key], plain[key])


def test_an_intervention_reads_as_the_same_edit_by_a_forward_hook():
    model = _model(True)
    handle = model[0].qkv.register_forward_hook(lambda mod, args, out: out * 2.0)
    with probe.watch(model, rows=None) as p:
        model(_x(1))
        edited = _values(p)
    handle.remove()
    traced = nnsight.NNsight(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.watch(model, rows=None) as p:
            with traced.trace(_x(1)):
                traced[0].qkv.output[:] = traced[0].qkv.output * 2.0
            got = _values(p)
            info = p.summary().info("0")
    for key in edited:
        np.testing.assert_allclose(got[key], edited[key], rtol=1e-6)
    assert info["scale"] is None  # written into a tensor: not recovered, and said
    assert any("'0' could not be recovered" in str(w.message) for w in caught)
