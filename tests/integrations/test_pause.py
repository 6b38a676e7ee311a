"""Probe.pause: the core hook the trainer integrations use to keep evaluation forwards out."""

from __future__ import annotations

import torch

import probe
from tests.helpers import SDPAModel
from tests.integrations.tbutil import Recorder


def test_pause_keeps_forwards_out_until_the_next_step() -> None:
    torch.manual_seed(0)
    model = SDPAModel(layers=1)
    sink = Recorder()
    x = torch.randn(2, 5, 64)
    with probe.watch(model, sinks=[sink], grads=False) as p:
        p.step(1)
        model(x)
        model(x)                       # two micro-batches of step 1
        p.pause(flush=False)
        model(x)                       # "evaluation": not probed
        p.step(1)
        model(x)                       # third micro-batch, still step 1
        p.pause(wait=True)             # step 1 over: flushed and written now
        assert [step for step, _ in sink.writes] == [1]
        model(x)                       # evaluation again: not probed
        p.step(2)
        model(x)
    # info "calls" counts every probed call so far: 3 in step 1, one more in step 2
    assert sink.writes == [(1, {"layers.0": 3}), (2, {"layers.0": 4})]
    assert p.summary().steps == 2


def test_pause_on_an_unsampled_step_flushes_nothing() -> None:
    model = SDPAModel(layers=1)
    sink = Recorder()
    with probe.watch(model, sinks=[sink], every=2, grads=False) as p:
        p.step(1)
        model(torch.randn(1, 3, 64))
        p.pause(wait=True)
        assert sink.writes == []
        p.step(2)
        model(torch.randn(1, 3, 64))
        p.pause(wait=True)
        assert [step for step, _ in sink.writes] == [2]
