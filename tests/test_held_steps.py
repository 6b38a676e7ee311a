"""A backward that comes after the next root forward began still counts for its own step.

Two views of a batch through one model before one backward (contrastive and siamese training),
or an evaluation forward between a forward and its backward: each root forward is a step (without
``p.step(n)``), and before, the hooks of the first were removed when the second began, so its
gradient metrics were lost with no warning (all of them, for the evaluation forward).
References: the same forwards and backwards run one after the other.
"""

from __future__ import annotations

import json
import math

import numpy as np
import torch

import probe
from probe.session.grad_hooks import HELD_STEPS
from tests.test_grads_integration import SpyAttention, _grad_values, _n_hooks
from tests.test_loss_scale import _model, _x


def _values(p: probe.Probe) -> dict:
    return _grad_values(p.summary())


def _same(a: dict, b: dict, rtol: float = 1e-12) -> None:
    assert a.keys() == b.keys() and a
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=rtol, atol=0, err_msg=str(key))


def test_two_views_before_one_backward_count_each_for_its_step():
    model = _model(False)
    with probe.watch(model, rows=None) as p:  # reference: each view's forward and backward in turn
        for _ in range(2):
            for seed in (1, 2):
                model(_x(seed)).square().mean().backward()
        ref = _values(p)
    model.zero_grad()
    with probe.watch(model, rows=None) as p:
        for _ in range(2):
            (model(_x(1)).square().mean() + model(_x(2)).square().mean()).backward()
        _same(_values(p), ref)


def test_coupled_views_against_grouped_steps():
    """A loss of both views: each forward's gradients count for its own step, so the root mean
    square over four steps is the grouped one (``p.step``: two steps of both views) over √2."""
    model = _model(False)
    runs = {}
    for grouped in (False, True):
        with probe.watch(model, rows=None) as p:
            for step in range(2):
                if grouped:
                    p.step(step)
                (model(_x(1)) * model(_x(2))).mean().backward()
            runs[grouped] = _values(p)
    _same({k: v * math.sqrt(2) for k, v in runs[False].items()}, runs[True])


def test_an_evaluation_forward_between_a_forward_and_its_backward():
    model = _model(False)
    with probe.watch(model, rows=None) as p:
        model(_x(1)).square().mean().backward()
        ref = _values(p)
    with probe.watch(model, rows=None) as p:
        out = model(_x(1))
        with torch.no_grad():
            model(_x(2))
        model(_x(3))  # with grad, its output dropped
        out.square().mean().backward()
        _same(_values(p), ref)


def test_held_hooks_go_once_their_backward_ran_or_their_outputs_are_gone():
    model = SpyAttention()
    with probe.watch(model) as p:
        first = model(torch.randn(1, 4, 32))  # step 0, output kept
        model(torch.randn(1, 4, 32))  # step 1, output dropped
        assert sum(_n_hooks(t) for t in model.seen[0]) == 4  # step 0 may still get its backward
        first.sum().backward()
        model(torch.randn(1, 4, 32))  # step 2: step 0's backward ran, step 1's output is gone
        assert sum(_n_hooks(t) for t in model.seen[0] + model.seen[1]) == 0
        assert p._rec.grad_hooks.held_steps() == []
        assert "grad_q" in p.summary().metrics("root")


def test_at_most_held_steps_wait_and_close_removes_them():
    model = SpyAttention()
    p = probe.watch(model)
    kept = [model(torch.randn(1, 4, 32)) for _ in range(HELD_STEPS + 3)]  # outputs kept, no backward
    assert p._rec.grad_hooks.held_steps() == list(range(2, HELD_STEPS + 2))
    assert sum(_n_hooks(t) for seen in model.seen[:2] for t in seen) == 0
    p.close()
    assert sum(_n_hooks(t) for seen in model.seen for t in seen) == 0
    assert len(kept) == HELD_STEPS + 3


def test_a_step_waits_while_any_of_its_outputs_lives():
    class TwoOutputs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _model(False)

        def forward(self, x):
            y = self.body(x)
            return y.mean(-1), y  # the first is dropped, the loss comes from the second

    model = TwoOutputs()
    with probe.watch(model, rows=None) as p:
        model(_x(1))[1].square().mean().backward()
        ref = _values(p)
    with probe.watch(model, rows=None) as p:
        feats = model(_x(1))[1]
        with torch.no_grad():
            model(_x(2))
        feats.square().mean().backward()
        _same(_values(p), ref)


def test_a_late_backward_goes_with_the_next_window_at_that_windows_last_step(tmp_path):
    from probe.sinks.jsonl import JSONLSink

    model = _model(False)
    path = tmp_path / "run.jsonl"
    with probe.watch(model, rows=None, sinks=[JSONLSink(str(path))]):
        for _ in range(3):  # steps 0-5; each odd step's window also gets its even step's gradients
            (model(_x(1)) * model(_x(2))).mean().backward()
    written = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        written.setdefault(record["metric"], set()).add(record["step"])
    assert written["entropy"] == set(range(6))  # was {0, 2, 4}: windows [1, 0] written at step 0
    assert written["grad_q"] == {1, 3, 5}
