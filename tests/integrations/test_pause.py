"""The profiler's hooks the trainer integrations use: Probe.pause keeps evaluation forwards out,
Probe.step(n, window=True) records a training step whole, ``offset`` samples a trainer's steps."""

from __future__ import annotations

import warnings

import pytest
import torch

import probe
from probe.session.lifecycle import Phase
from tests.helpers import SDPAModel, hook_count
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


class Wrapper(torch.nn.Module):
    """A LightningModule-like root: the training code calls ``enc`` itself, never ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = SDPAModel(layers=2, d_model=32, heads=2)

    def forward(self, x):
        return self.enc(x)


def test_a_window_records_whatever_runs_forward_and_backward() -> None:
    model, sink = Wrapper(), Recorder()
    x = torch.randn(2, 5, 32)
    with probe.watch(model, sinks=[sink], every=2) as p:
        for step in range(4):
            for _ in range(2):                          # two micro-batches, one window each
                p.step(step, window=True)
                assert p.phase is (Phase.WINDOW if step % 2 == 0 else Phase.STEP)
                model.enc(x).square().mean().backward()  # the parts, not the root's forward
                model(x).square().mean().backward()      # and the root: counted once, not twice
                p.pause(flush=False)
                assert p.phase is Phase.PAUSED
                model.enc(x)                             # "validation" between windows: not recorded
        p.flush()
        summary = p.summary()
    assert sink.writes == [(0, {"enc.layers.0": 4, "enc.layers.1": 4}), (2, {"enc.layers.0": 8, "enc.layers.1": 8})]
    assert set(summary.metrics("enc.layers.0")) >= {"entropy", "grad_q", "grad_logits"}
    assert hook_count(model) == 0 and not torch.overrides._is_torch_function_mode_enabled()


def test_close_ends_an_open_window() -> None:
    model = Wrapper()
    p = probe.watch(model, grads=False)
    p.step(0, window=True)
    model.enc(torch.randn(1, 3, 32))
    p.close()
    assert p.phase is Phase.CLOSED and not torch.overrides._is_torch_function_mode_enabled()
    assert p.summary().info("enc.layers.0")["calls"] == 1


def test_offset_samples_steps_every_minus_one() -> None:
    model, sink = SDPAModel(layers=1), Recorder()
    with probe.watch(model, every=3, offset=2, sinks=[sink], grads=False) as p:
        for _ in range(7):
            model(torch.randn(1, 3, 64))                 # automatic steps 0..6
    assert [step for step, _ in sink.writes] == [2, 5]
    with pytest.raises(probe.ProbeError, match=r"`offset` to be in \[0, every\)"):
        probe.watch(model, every=3, offset=3)


def test_the_warning_for_a_step_without_the_roots_forward_points_at_the_window() -> None:
    model = Wrapper()
    with pytest.warns(UserWarning, match=r"never ran .* p\.step\(n, window=True\)"):
        with probe.watch(model, grads=False) as p:
            p.step(0)
            model.enc(torch.randn(1, 3, 32))
            p.step(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")               # the same loop with the window: recorded, no warning
        with probe.watch(model, grads=False) as p:
            p.step(0, window=True)
            model.enc(torch.randn(1, 3, 32))
            p.step(1, window=True)
        assert p.summary().sites == ["enc.layers.0", "enc.layers.1"]


def test_a_window_measures_what_the_roots_forward_measures() -> None:
    model, x = Wrapper(), torch.randn(2, 5, 32)
    summaries = []
    for window in (False, True):
        with probe.watch(model, rows=None) as p:
            p.step(0, window=window)
            (model(x) if not window else model.enc(x)).square().mean().backward()  # the root, or its part
        summaries.append(p.summary())
    for site in ("enc.layers.0", "enc.layers.1"):
        for metric in ("entropy", "max_prob", "logit_max", "grad_logits", "grad_q"):
            assert summaries[0].value(site, metric).tolist() == summaries[1].value(site, metric).tolist(), (site, metric)
