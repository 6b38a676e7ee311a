"""The demo's reading of the grad ratio when the softmax gradient is 0, tiny or infinite.

A fully saturated softmax passes back exactly 0 in float32 (unscaled logits in the thousands late
in training): the reading must say so, not raise ZeroDivisionError at the end of the demo.
"""

from __future__ import annotations

import math

import probe
from probe.cli.demo import WITH, WITHOUT, format_table, reading


def _run(unscaled, standard=2e-3):
    steps = {}
    for step, grad in zip((0, 95), unscaled):
        metrics = {"entropy": {"actual": [0.5]}, "saturation": {"actual": [0.25]}, "logit_max": {"actual": [40.0]}, "nonfinite": {"actual": [0.0]},
                   "grad_logits": {"actual": [1e-3], "standard": [standard], "unscaled": [grad]}}
        steps[step] = probe.Summary({"a": {"info": {}, "metrics": metrics}}, steps=1)
    return {"summary": steps[95], "steps": steps, "first_loss": 3.0, "loss": 2.0, "losses": [3.0] + [2.0] * 99,
            "counting": 0.7, "one_token": 2.4}


def test_a_softmax_gradient_of_exactly_zero_is_read_as_zero():
    runs = {WITH: _run((2e-3, 2e-3)), WITHOUT: _run((1.5e-3, 0.0))}
    text = reading(runs, d_k=64)
    assert "at step 95" in text and "0 (no gradient at all)" in text
    assert format_table(runs).splitlines()[-1].split()[-2:] == ["0.750", "0.000"]


def test_a_tiny_ratio_is_written_compactly_and_an_infinite_divisor_is_not_a_ratio():
    text = reading({WITH: _run((2e-3, 2e-3)), WITHOUT: _run((1.5e-3, 2e-3 * 1e-30))}, d_k=64)
    assert "1.0e+30x smaller at step 95" in text
    runs = {WITH: _run((2e-3, 2e-3)), WITHOUT: _run((1.5e-3, 1.0), standard=math.inf)}
    text = reading(runs, d_k=64)
    assert "not measured at step 0" in text  # x / inf is no measurement of the ratio
    assert format_table(runs).splitlines()[-1].split()[-2:] == ["-", "-"]
