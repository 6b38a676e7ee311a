"""Probe's lifecycle (probe/session/lifecycle.py): the transition table, and the phases a probe
goes through as a training loop drives it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import probe
from probe.session.lifecycle import TRANSITIONS, Counting, Event, Lifecycle, Phase
from tests.helpers import SDPAModel


class Spy(nn.Module):
    """A root whose forward notes the probe's phase while it runs (and can call itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = SDPAModel(layers=1)
        self.seen = []
        self.probe = None
        self.again = False

    def forward(self, x):
        self.seen.append(self.probe.phase)
        if self.again:
            self.again = False
            self(x)  # the root calls itself: no transition, only depth
            self.seen.append(self.probe.phase)
        return self.inner(x)


def _watch(model, **kw):
    p = probe.watch(model, **kw)
    model.probe = p
    return p


def test_every_event_in_every_phase_has_a_row():
    open_phases = [phase for phase in Phase if phase is not Phase.CLOSED]
    assert all((event, phase) in TRANSITIONS for event in (Event.STEP, Event.PAUSE) for phase in open_phases)
    assert all((Event.CLOSE, phase) in TRANSITIONS for phase in Phase)
    assert not any(event is not Event.CLOSE and phase is Phase.CLOSED for event, phase in TRANSITIONS)
    for (event, phase), targets in TRANSITIONS.items():
        assert targets, (event, phase)
        assert Phase.READY not in targets  # nothing goes back to READY


def test_a_move_the_table_does_not_allow_warns_once_and_is_taken():
    life = Lifecycle()
    with pytest.warns(RuntimeWarning, match="internal error: FORWARD_END in phase READY"):
        life.move(Event.FORWARD_END, Phase.STEP)
    assert life.phase is Phase.STEP
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        life.move(Event.STEP, Phase.CAPTURE)  # a second bad move: not warned again
    assert life.phase is Phase.CAPTURE


def test_phases_of_a_training_loop():
    model = Spy()
    x = torch.randn(2, 5, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no internal error on the way
        p = _watch(model, every=2)
        assert p.phase is Phase.READY
        model(x)  # step 0, recorded
        assert p.phase is Phase.STEP and p.current_step == 0
        model(x)  # step 1, skipped
        model.again = True
        model(x)  # step 2, recorded, and the root calls itself
        # the nested call runs (and notes) inside the outer one, which is still capturing after it
        assert model.seen == [Phase.CAPTURE, Phase.BYPASS, Phase.CAPTURE, Phase.CAPTURE, Phase.CAPTURE]
        assert p.current_step == 2  # the nested call began no step
        p.pause()
        assert p.phase is Phase.PAUSED
        model(x)  # paused: untouched, but it still counts as a step (automatic counting)
        assert model.seen[-1] is Phase.BYPASS and p.phase is Phase.PAUSED and p.current_step == 3
        p.step(10)
        assert p.phase is Phase.STEP and p._life.counting is Counting.EXPLICIT
        model(x)
        model(x)  # two micro-batches of step 10
        assert model.seen[-2:] == [Phase.CAPTURE, Phase.CAPTURE] and p.current_step == 10
        p.close()
        assert p.phase is Phase.CLOSED
    assert p.summary().steps == 3  # steps 0, 2 and 10


def test_pause_inside_a_forward_takes_effect_at_its_end():
    class Pauses(Spy):
        def forward(self, x):
            self.probe.pause(flush=False)
            return super().forward(x)

    model = Pauses()
    p = _watch(model)
    model(torch.randn(1, 3, 64))
    assert model.seen == [Phase.CAPTURE] and p.phase is Phase.PAUSED
    assert p.summary().steps == 1  # the forward that paused was recorded
    p.close()


def test_an_interrupted_forward_returns_to_its_phase_at_the_next_call():
    class Interrupts(Spy):
        def forward(self, x):
            super().forward(x)
            raise KeyboardInterrupt

    model = Interrupts()
    p = _watch(model)
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(1, 3, 64))
    assert p.phase is Phase.CAPTURE  # the forward hook never ran
    p.summary()  # any call on the probe notices
    assert p.phase is Phase.STEP
    p.close()
