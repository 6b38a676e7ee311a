"""Run-level gradient norms are a root mean square over probed steps: independent of run length."""

from __future__ import annotations

import numpy as np
import torch

import probe
from tests.helpers import SDPAModel


def _summary(steps: int, every: int = 1, eval_steps: int = 0):
    torch.manual_seed(0)
    model = SDPAModel(layers=1, d_model=16, heads=2)
    x = torch.randn(2, 5, 16)
    with probe.watch(model, every=every) as p:
        for _ in range(steps):
            model(x).sum().backward()  # the same batch and weights: every step has the same gradient
        with torch.no_grad():
            for _ in range(eval_steps):  # probed steps without a backward pass
                model(x)
    return p.summary()


def test_same_gradient_every_step_gives_the_same_run_value_at_any_length():
    one, many = _summary(1), _summary(6)
    assert many.steps == 6 and many.meta["first_step"] == 0 and many.meta["last_step"] == 5
    for metric in ("grad_logits", "grad_q", "grad_k", "grad_v"):
        np.testing.assert_allclose(many.value("layers.0", metric), one.value("layers.0", metric), rtol=1e-5)
    # a probed step without backward does not dilute the gradient (it has none to average)
    np.testing.assert_allclose(_summary(2, eval_steps=2).value("layers.0", "grad_q"),
                               one.value("layers.0", "grad_q"), rtol=1e-5)
