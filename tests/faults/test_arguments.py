"""Bad arguments are a ProbeError at watch() (never inside the model's forward), and a closed
probe refuses to be used again."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import probe
from tests.helpers import SDPAModel


def test_numpy_scales_of_any_float_type_are_accepted():
    model = SDPAModel(layers=1)
    with probe.watch(model, scales={"a": np.float32(0.125), "b": np.float64(0.25), "c": np.int64(1)}) as p:
        model(torch.randn(1, 3, 64))
    s = p.summary()
    assert set(s.scales("layers.0", "entropy")) == {"actual", "unscaled", "standard", "a", "b", "c"}
    np.testing.assert_allclose(s.value("layers.0", "entropy", "c"), s.value("layers.0", "entropy", "unscaled"))


@pytest.mark.parametrize("fn, message", [
    (lambda d: 1 / 0, "raised ZeroDivisionError"),
    (lambda d: "0.1", "to return a finite float, got '0.1'"),
    (lambda d: math.nan, "to return a finite float, got nan"),
    (lambda: 0.1, "raised TypeError"),
])
def test_a_bad_scale_callable_fails_at_watch(fn, message):
    with pytest.raises(probe.ProbeError, match=message.replace("(", r"\(")):
        probe.watch(SDPAModel(layers=1), scales={"bad": fn})


def test_a_scale_callable_failing_for_another_d_k_warns_and_skips_it_in_the_forward():
    model = SDPAModel(layers=1)  # d_k = 16
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with probe.watch(model, scales={"picky": lambda d: 0.1 if d == 64 else 1 / 0}) as p:
            model(torch.randn(1, 3, 64))  # runs: the model's forward never sees the error
    assert any("scales['picky']`(16) raised ZeroDivisionError" in str(w.message) for w in record)
    assert "picky" not in p.summary().scales("layers.0", "entropy")


@pytest.mark.parametrize("name", ["a\nb", "x:y", "ünï", "1st", "a b", "a@b", "a/b", ""])
def test_scale_names_that_thresholds_cannot_address_are_refused(name):
    with pytest.raises(probe.ProbeError, match="`scales` names"):
        probe.watch(SDPAModel(layers=1), scales={name: 0.1})


def test_an_empty_logdir_is_an_error():
    with pytest.raises(probe.ProbeError, match="empty string"):
        probe.watch(SDPAModel(layers=1), logdir="")


def test_a_closed_probe_refuses_step_and_with():
    p = probe.watch(SDPAModel(layers=1))
    p.close()
    with pytest.raises(probe.ProbeError, match="closed"):
        p.step(3)
    with pytest.raises(probe.ProbeError, match="closed"):
        with p:
            pass
    p.close()  # closing twice stays harmless
